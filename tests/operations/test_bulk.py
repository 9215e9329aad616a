"""Acting on every row a filter selects: retry or purge parked rows, cancel pending ones, by
family, command, actor, error text and age, in batches; a dry run counts and shows a sample and
changes nothing; the whole action is one audit row."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.core.rows import RowFilter
from outbox_dispatch.ops import actions
from tests.conftest import count_rows
from tests.fixtures.processes import ROOT, cli

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


def test_a_bulk_retry_whose_database_goes_away_mid_way_stops_cleanly_and_a_rerun_finishes(
    clean_acc: dict[str, str], tmp_path: Path
) -> None:
    """Terminate the CLI's backend while it waits in its third batch (another session holds
    one of that batch's rows): it stops with how many rows it did, every row is retried whole
    or still parked, and the same command run again retries the rest."""
    env, schema = clean_acc, clean_acc["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        ids = [
            int(r[0])
            for r in conn.execute(
                f'INSERT INTO "{schema}".outbox (family, command, actor, payload, due_at,'
                " created_at, parked_at, attempts, last_error) SELECT 'custom', 'acc.custom',"
                " 'shop:' || n, '{}', '2000-01-01', now(), now(), 3, 'ConnectionError: down'"
                " FROM generate_series(1, 3000) n RETURNING id"
            ).fetchall()
        ]
    ids.sort()
    command = ["parked", "retry", "--command", "acc.custom", "--by", "ops", "--reason", "up"]
    with psycopg.connect(url) as locker, psycopg.connect(url, autocommit=True) as admin:
        # a row of the third batch (batches of 500 in id order) held by another session
        locker.execute(f'SELECT 1 FROM "{schema}".outbox WHERE id = %s FOR UPDATE', (ids[1200],))
        err = (tmp_path / "bulk.err").open("w+")
        run = subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatch.ops.cli", *command],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            blocked = _blocked_behind(admin, locker.info.backend_pid, run)
            admin.execute("SELECT pg_terminate_backend(%s)", (blocked,))
            out, _ = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
            locker.rollback()
        err.seek(0)
        stderr = err.read()
        err.close()
    assert run.returncode == 2, (out, stderr)
    assert "retry: 500/3000" in stderr and "retry: 1000/3000" in stderr
    assert "retry stopped after 1000 of 3000 rows" in stderr
    assert "terminating connection due to administrator command" in stderr
    assert "no row is half done: run it again to finish" in stderr
    assert "Traceback" not in stderr  # a clean stop, not a crash
    # the two batches that committed are retried whole; the rest are untouched
    first = ", ".join(map(str, ids[:1000]))
    retried = "parked_at IS NULL AND attempts = 0 AND due_at > '2001-01-01'"
    untouched = "parked_at IS NOT NULL AND attempts = 3 AND due_at = '2000-01-01'"
    assert count_rows(url, schema, f"id IN ({first}) AND {retried}") == 1000
    assert count_rows(url, schema, f"NOT id IN ({first}) AND {untouched}") == 2000
    audit = json.loads(cli(env, "--json", "audit", "--limit", "1").stdout)
    assert (audit[0]["action"], audit[0]["rows"], audit[0]["by"]) == ("retry", 1000, "ops")
    assert audit[0]["selection"]["interrupted"] is True

    again = cli(env, *command)
    assert again.returncode == 0, again.stderr
    assert "2000 rows due again" in again.stdout
    assert count_rows(url, schema, retried) == 3000


def _blocked_behind(admin: psycopg.Connection[Any], locker: int, run: subprocess.Popen[str]) -> int:
    """The backend that waits for ``locker``'s row lock (the bulk's third batch)."""
    deadline = time.monotonic() + 60
    while True:
        assert run.poll() is None, "the bulk ended before it reached the locked row"
        found = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (locker,)
        ).fetchone()
        if found is not None:
            return int(found[0])
        assert time.monotonic() < deadline, "the bulk never waited for the locked row"
        time.sleep(0.05)
