"""Acting on every row a filter selects: retry or purge parked rows, cancel pending ones, by
family, command, actor, error text and age, in batches; a dry run counts and shows a sample and
changes nothing; the whole action is one audit row."""

from __future__ import annotations

import json

import psycopg
import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.core.rows import RowFilter
from outbox_dispatch.ops import actions
from tests.conftest import count_rows
from tests.fixtures.processes import cli

pytestmark = pytest.mark.usefixtures("clean")


def _rows(database_url: str, schema: str, values: str) -> list[int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, actor, payload, parked_at,'
            f" created_at, attempts, last_error) VALUES {values} RETURNING id"
        ).fetchall()
    return [int(r[0]) for r in found]


def test_retry_purge_and_cancel_by_filter_in_batches(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    old = "now() - interval '2 hours'"
    timeouts = _rows(
        database_url,
        schema,
        ", ".join(
            f"('quick', 'mail.send', 'shop:{i}', '{{}}', {old}, {old}, 3, "
            "'TimeoutError: 50% of smtp_pool busy')"
            for i in range(7)
        ),
    )
    other = _rows(
        database_url,
        schema,
        f"('quick', 'mail.send', 'shop:9', '{{}}', now(), now(), 3, 'KeyError: x'),"
        f" ('bulk', 'mail.send', 'shop:8', '{{}}', {old}, {old}, 3, 'TimeoutError: 50% of'),"
        " ('quick', 'mail.send', 'shop:7', '{}', NULL, now(), 0, NULL)",
    )
    where = RowFilter(family="quick", error="50% of smtp_pool", older_than=3600)
    dry = actions.bulk(dispatcher, "retry", where, dry_run=True)
    assert dry.count == 7 and len(dry.sample) == 5 and dry.dry_run
    assert count_rows(database_url, schema, "parked_at IS NOT NULL") == 9  # nothing changed
    seen: list[tuple[int, int]] = []
    done = actions.bulk(
        dispatcher,
        "retry",
        where,
        by="ops",
        reason="smtp back",
        batch=3,
        progress=lambda d, c: seen.append((d, c)),
    )
    assert (done.count, done.done) == (7, 7)
    assert seen == [(3, 7), (6, 7), (7, 7)]  # three batches, each its own transaction
    ids = ", ".join(map(str, timeouts))
    assert count_rows(database_url, schema, f"id IN ({ids}) AND parked_at IS NULL") == 7
    assert count_rows(database_url, schema, f"id = {other[1]} AND parked_at IS NOT NULL") == 1
    # the LIKE wildcards in the text match only themselves: '_' is not any character
    assert actions.bulk(dispatcher, "purge", RowFilter(error="smtp?pool"), dry_run=True).count == 0
    purged = actions.bulk(dispatcher, "purge", RowFilter(family="quick", error="KeyError"))
    assert purged.done == 1 and count_rows(database_url, schema, f"id = {other[0]}") == 0
    cancelled = actions.bulk(dispatcher, "cancel", RowFilter(family="quick", actor="shop:7"))
    assert cancelled.done == 1
    assert count_rows(database_url, schema, f"id = {other[2]} AND cancelled_at IS NOT NULL") == 1
    log = dispatcher.ops.audit_log(limit=3)
    assert [(r["action"], r["rows"]) for r in log] == [("cancel", 1), ("purge", 1), ("retry", 7)]
    assert log[2]["selection"] == {
        "filter": {"family": "quick", "error": "50% of smtp_pool", "older_than": 3600}
    }
    assert (log[2]["by"], log[2]["reason"]) == ("ops", "smtp back")


def test_the_cli_previews_then_acts_on_a_selection(clean_acc: dict[str, str]) -> None:
    env, schema = clean_acc, clean_acc["OUTBOX_TEST_SCHEMA"]
    _rows(
        env["OUTBOX_TEST_DATABASE_URL"],
        schema,
        ", ".join(
            f"('intent', 'acc.x', 'a:{i}', '{{}}', now(), now(), 1, 'ConnectionError: down')"
            for i in range(4)
        ),
    )
    dry = cli(env, "parked", "retry", "--error", "ConnectionError", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "4 rows would be due again" in dry.stdout and "a:0" in dry.stdout
    as_json = cli(env, "--json", "parked", "purge", "--error", "ConnectionError", "--dry-run")
    assert json.loads(as_json.stdout)["count"] == 4
    done = cli(env, "parked", "purge", "--error", "ConnectionError", "--by", "gina")
    assert done.returncode == 0 and "4 rows deleted" in done.stdout
    assert "purge: 4/4" in done.stderr
    bad = cli(env, "parked", "retry", "--older-than", "soon")
    assert bad.returncode == 2 and "not an age like 90s, 30m, 2h, 1d" in bad.stderr
