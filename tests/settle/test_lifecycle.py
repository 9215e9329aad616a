"""A row's life cycle in one process, as it settles: a transactional handler's writes commit
with its settle, a lost attempt parks when its family says so, a handler that kills its
worker every time is parked, and retention keeps settled rows (and their dedupe keys) until
prune deletes them, in batches."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher
from tests.conftest import count_rows
from tests.support.lifecycle import (
    _effects_table,
    _name,
    _one,
    _row,
    life_dispatcher,  # noqa: F401 (the fixture life)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_transactional_handler_commits_its_writes_with_the_settle(
    life: Dispatcher, database_url: str
) -> None:
    table = _effects_table(database_url, life.schema)
    cmd = _name()

    @life.handler(cmd, family="short", transactional=True)
    def write(ctx: Context, payload: Any) -> None:
        note = f"{payload['note']} from attempt {ctx.attempt}"
        ctx.conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (ctx.row_id, note))
        if ctx.attempt == 1:
            raise RuntimeError("after writing: the write must roll back")

    row_id = _one(life, database_url, cmd, {"note": "hello"})
    report = life.drain(timeout=5)  # the retry may run in the same drain: its backoff is short
    while not report.delivered:
        time.sleep(0.05)
        report = life.drain(timeout=5)
    with psycopg.connect(database_url) as conn:
        effects = conn.execute(f"SELECT row_id, note FROM {table}").fetchall()
    assert effects == [(row_id, "hello from attempt 2")]  # attempt 1's write rolled back
    assert count_rows(database_url, life.schema, f"id = {row_id}") == 0


def test_lost_attempt_parks_when_the_family_says_so(life: Dispatcher, database_url: str) -> None:
    cmd = _name()
    life.handler(cmd, family="fragile")(lambda ctx, p: None)
    row_id = _one(life, database_url, cmd)
    claimed = life.claimer.claim_family(life.families["fragile"]).claimed[0]
    assert life.store.begin(row_id, claimed.token, 30) is not None  # started, then its worker died
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{life.schema}".outbox SET due_at = now() WHERE id = %s', (row_id,))
    result = life.claimer.claim_family(life.families["fragile"])
    assert result.parked == [row_id]
    row = _row(database_url, life.schema, row_id)
    assert row["maybe_applied"] and "ended without an outcome" in row["last_error"]


def test_retention_keeps_dedupe_keys_and_prune_deletes_only_expired_rows_in_batches(
    life: Dispatcher, database_url: str
) -> None:
    cmd, brief = _name(), _name()
    life.handler(cmd, family="kept")(lambda ctx, p: None)
    life.handler(brief, family="gone")(lambda ctx, p: None)
    first = _one(life, database_url, cmd, dedupe_key="kept:1")
    life.drain(timeout=5)
    assert _row(database_url, life.schema, first)["done_at"] is not None
    assert _one(life, database_url, cmd, dedupe_key="kept:1") == first  # still deduplicated
    ids = [_one(life, database_url, cmd) for _ in range(7)]
    life.drain(timeout=5)
    with psycopg.connect(database_url, autocommit=True) as conn:  # 5 of them are 2 hours old
        conn.execute(
            f"UPDATE \"{life.schema}\".outbox SET done_at = now() - interval '2 hours'"
            " WHERE id = ANY(%s)",
            (ids[:5],),
        )
    calls: list[int] = []
    real = life.store.prune

    def spy(family: str, retention: float, batch: int) -> int:
        n = real(family, retention, batch)
        calls.append(n)
        return n

    life.store.prune = spy  # type: ignore[method-assign]
    try:
        assert life.ops.prune(batch=2) == {"kept": 5}
    finally:
        life.store.prune = real  # type: ignore[method-assign]
    assert [n for n in calls if n] == [2, 2, 1]  # batches of at most 2 rows
    left = count_rows(database_url, life.schema, f"id = ANY(ARRAY{[first, *ids]})")
    assert left == 3  # the recent ones stay


def test_a_handler_that_kills_its_worker_every_time_is_parked_even_in_intent(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    life.handler(cmd, family="intent")(lambda ctx, p: None)  # intent retries forever
    row_id = _one(life, database_url, cmd)
    fam = life.families["intent"]
    for _ in range(fam.max_lost + 1):  # max_lost attempts start and die; the next claim parks
        result = life.claimer.claim_family(fam)
        if result.parked:
            break
        claimed = next(c for c in result.claimed if c.id == row_id)
        assert life.store.begin(row_id, claimed.token, 30) is not None  # ...and dies
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                f'UPDATE "{life.schema}".outbox SET due_at = now() WHERE id = %s', (row_id,)
            )
    row = _row(database_url, life.schema, row_id)
    assert row["parked_at"] is not None
    assert row["lost_attempts"] == fam.max_lost
