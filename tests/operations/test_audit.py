"""Every operator action is a row of the audit log, whichever surface did it (Python, the CLI,
the page, the admin): when, who, what, the selection, how many rows, why. It is kept for the
dispatcher's audit_retention and pruned with the rows."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.ops import actions
from tests.fixtures.processes import cli

pytestmark = pytest.mark.usefixtures("clean")


def _parked(database_url: str, schema: str, n: int) -> list[int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
            " last_error) SELECT 'quick', 't.audit', '{}', now(), 3, 'boom'"
            " FROM generate_series(1, %s) RETURNING id",
            (n,),
        ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.fixture
def fresh_audit(database_url: str, schema: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox_audit')


@pytest.mark.usefixtures("fresh_audit")
def test_each_action_is_recorded_with_who_what_how_many_and_why(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    ids = _parked(database_url, schema, 3)
    actions.retry_parked(dispatcher, ids[:2], by="alice", reason="provider fixed")
    actions.purge_parked(dispatcher, [ids[2]], by="bob")
    dispatcher.ops.pause("quick", reason="maintenance", by="carol")
    dispatcher.ops.resume("quick")  # by nobody given: the OS user, marked as Python
    log = dispatcher.ops.audit_log(limit=10)
    got = [(r["action"], r["by"], r["rows"], r["reason"]) for r in reversed(log)]
    assert got[:3] == [
        ("retry", "alice", 2, "provider fixed"),
        ("purge", "bob", 1, None),
        ("pause", "carol", 0, "maintenance"),
    ]
    assert got[3][0] == "resume" and got[3][1].endswith("(python)")
    assert log[-1]["selection"] == {"ids": ids[:2], "family": None}


@pytest.mark.usefixtures("fresh_audit")
def test_the_audit_log_outlives_the_rows_and_is_pruned_after_its_retention(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    ids = _parked(database_url, schema, 1)
    actions.purge_parked(dispatcher, ids, by="dave")
    assert [r["action"] for r in dispatcher.ops.audit_log()] == ["purge"]  # the row is gone
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"UPDATE \"{schema}\".outbox_audit SET at = now() - interval '91 days'")
    actions.retry_parked(dispatcher, None, family="nope", by="erin")  # a recent one stays
    dispatcher.ops.prune()
    assert [r["by"] for r in dispatcher.ops.audit_log()] == ["erin"]


def test_the_cli_records_who_acted_and_lists_the_log(clean_acc: dict[str, str]) -> None:
    env, schema = clean_acc, clean_acc["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox_audit')
        found = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts)'
            " VALUES ('intent', 'acc.x', '{}', now(), 1) RETURNING id"
        ).fetchone()
    assert found is not None
    retried = cli(env, "parked", "retry", str(found[0]), "--by", "frank", "--reason", "fixed")
    assert retried.returncode == 0, retried.stderr
    listed = cli(env, "audit", "--json")
    assert listed.returncode == 0, listed.stderr
    log: list[dict[str, Any]] = json.loads(listed.stdout)
    assert [(r["action"], r["by"], r["rows"], r["reason"]) for r in log] == [
        ("retry", "frank", 1, "fixed")
    ]
    assert "frank" in cli(env, "audit").stdout
