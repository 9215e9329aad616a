"""Settles that review found wanting (invariant 12 and issue 12), against the real Postgres and
Redis: a handler stopped at its time limit is retried, never settled as delivered; a family
that keeps its rows forever keeps them while the others are pruned; one family's maintenance
failure does not stop the others'."""

from __future__ import annotations

import math
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, DatabaseError, Dispatcher, Message, OutboxError, Outcome
from tests.conftest import count_rows
from tests.support.review import (
    _claim,
    _enqueue,
    _handler,
    _name,
    _row,
    _until_cancelled,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


# -- 2. nothing settles as delivered unless its handler returned on its own --------------------


def test_a_handler_that_stops_at_its_time_limit_is_retried_not_deleted(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("limit")
    d.family(fam, time_limit=0.5, lease=10)
    cmd = _handler(d, fam, _until_cancelled(10))
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, fam)
    t0 = time.monotonic()
    result = d.delivery.deliver(c.id, c.token, family_hint=fam)
    assert result.outcome is Outcome.RETRIED
    assert time.monotonic() - t0 < 5  # it was told to stop: it did not run its 10 s
    row = _row(database_url, schema, row_id)
    assert row is not None, "the row was deleted as delivered"
    assert row["claim_token"] is None and row["attempts"] == 1 and row["maybe_applied"]
    assert "time_limit" in row["last_error"]


def test_a_transactional_handler_stopped_at_its_time_limit_rolls_back_and_is_retried(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    table = f'"{schema}".inv_effects_{uuid.uuid4().hex[:6]}'
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (row_id bigint)")
    fam = _name("txlimit")
    d.family(fam, time_limit=0.5, lease=10)
    wait = _until_cancelled(10)

    def handler(ctx: Context, payload: Any) -> None:
        ctx.conn.execute(f"INSERT INTO {table} VALUES (%s)", (ctx.row_id,))
        wait(ctx, payload)

    cmd = _handler(d, fam, handler, transactional=True)
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, fam)
    assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.RETRIED
    with psycopg.connect(database_url) as conn:
        found = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert found == (0,), "the stopped handler's writes committed"
    row = _row(database_url, schema, row_id)
    assert row is not None and not row["maybe_applied"]  # rolled back: nothing was applied


@pytest.mark.parametrize("forever", [math.inf, timedelta.max])
def test_a_keep_forever_retention_keeps_rows_and_prunes_the_other_families(
    d: Dispatcher, database_url: str, schema: str, forever: float | timedelta
) -> None:
    keep, gone = _name("forever"), _name("gone")
    d.family(keep, retention=forever)
    d.family(gone, retention=0.001)
    kept = _handler(d, keep, lambda ctx, p: None)
    pruned = _handler(d, gone, lambda ctx, p: None)
    ids = _enqueue(d, database_url, [Message(kept, {}), Message(pruned, {})])
    for fam in (keep, gone):
        [c] = _claim(d, fam)
        assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.DELIVERED
    time.sleep(0.01)
    deleted = d.ops.prune()
    assert deleted.get(gone) == 1 and keep not in deleted
    assert count_rows(database_url, schema, f"id = {ids[0]} AND done_at IS NOT NULL") == 1


def test_one_familys_maintenance_failure_does_not_stop_the_others(
    d: Dispatcher, database_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken, line, gone = _name("broken"), _name("line"), _name("pruned")
    d.family(broken, retention=10)
    d.family(line, ordered=True)
    d.family(gone, retention=0.001)
    lined = _handler(d, line, lambda ctx, p: None)
    done = _handler(d, gone, lambda ctx, p: None)
    _enqueue(d, database_url, [Message(done, {})])
    [c] = _claim(d, gone)
    d.delivery.deliver(c.id, c.token, family_hint=gone)
    head, behind = _enqueue(d, database_url, [Message(lined, {}, actor="L")] * 2)
    with psycopg.connect(database_url, autocommit=True) as conn:  # a crash lost the head
        conn.execute(f'DELETE FROM "{schema}".outbox WHERE id = %s', (head,))
    prune = d.store.prune

    def failing(family: str, retention: float, batch: int) -> int:
        if family == broken:
            raise DatabaseError("prune failed: canceling statement due to lock timeout")
        return prune(family, retention, batch)

    monkeypatch.setattr(d.store, "prune", failing)
    time.sleep(0.01)
    # the broken family comes first: the others are maintained all the same
    rest = {name: fam for name, fam in d.families.items() if name != broken}
    first = d.families[broken]
    d.families.clear()
    d.families.update({broken: first, **rest})
    with pytest.raises(OutboxError, match=broken):
        d.ops.prune()
    assert count_rows(database_url, schema, f"family = '{gone}'") == 0
    assert count_rows(database_url, schema, f"id = {behind} AND NOT blocked") == 1
