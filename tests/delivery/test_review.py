"""Lost attempts come back (invariants 11 and 13, and defects an adversarial review found,
issue 12), against the real Postgres and Redis: no count of dead started rows stops a
family's claims, a dead worker's started row is due again after the heartbeat timeout, not
the lease, and a live attempt's lease goes on being renewed next to a stale attempt of its
row, or on a connection of its own."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Context, Dispatcher, Message, Outcome
from tests.conftest import count_rows
from tests.support.review import (
    _claim,
    _enqueue,
    _handler,
    _lapse,
    _name,
    _row,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


# -- 1. a family always makes progress ---------------------------------------------------------


def test_dead_started_rows_at_max_in_flight_are_claimed_again(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    """max_in_flight=1 and one worker killed mid-run: its row is claimed again once its lease
    ran out, as a lost attempt, and the family goes on with the rest."""
    fam = _name("tiny")
    d.family(fam, max_in_flight=1, lease=5)
    ran: list[tuple[int, int, bool]] = []
    cmd = _handler(d, fam, lambda ctx, p: ran.append((ctx.row_id, ctx.attempt, ctx.maybe_applied)))
    first, second = _enqueue(d, database_url, [Message(cmd, {}), Message(cmd, {})])
    [c] = _claim(d, fam)
    assert c.id == first
    assert d.store.begin(c.id, c.token, 5) is not None  # started, then the worker died
    assert _claim(d, fam) == []  # its lease still runs: in flight
    _lapse(database_url, schema, first)
    [again] = _claim(d, fam)
    assert again.id == first and again.attempts == 2
    assert d.delivery.deliver(again.id, again.token, family_hint=fam).outcome is Outcome.DELIVERED
    [nxt] = _claim(d, fam)
    assert nxt.id == second
    assert d.delivery.deliver(nxt.id, nxt.token, family_hint=fam).outcome is Outcome.DELIVERED
    assert ran == [(first, 2, True), (second, 1, False)]


def test_a_whole_fleet_crash_at_the_default_in_flight_limit_does_not_stop_the_family(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("fleet")
    d.family(fam)  # max_in_flight 1000
    cmd = _handler(d, fam, lambda ctx, p: None)
    _enqueue(d, database_url, [Message(cmd, {}) for _ in range(1001)])
    claimed = d.claimer.claim_family(d.families[fam], batch=1000).claimed
    assert len(claimed) == 1000
    started = [d.store.begin(c.id, c.token, 30) for c in claimed]
    assert all(s is not None for s in started)  # every worker died mid-run
    with psycopg.connect(database_url, autocommit=True) as conn:
        # an hour back: the dead attempts sort before the row never claimed, however slow the run
        conn.execute(
            f"UPDATE \"{schema}\".outbox SET due_at = now() - interval '1 hour' "
            "WHERE claim_token IS NOT NULL"
        )
    again = d.claimer.claim_family(d.families[fam], batch=1000).claimed
    assert len(again) == 1000 and all(c.attempts == 2 for c in again)


# -- 6. heartbeats of a stale attempt and its re-claim in one process --------------------------


def test_a_stale_attempt_ending_does_not_end_the_heartbeat_of_its_rows_re_claim(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    """A threads pool runs a stale attempt and the re-claim of its row side by side: when the
    stale one ends, the live one's lease must still be renewed."""
    fam = _name("hb")
    d.family(fam, lease=10, heartbeat_timeout=1.0)
    stale_running, live_running, stale_may_return = (threading.Event() for _ in range(3))
    live_lease: list[float] = []

    def handler(ctx: Context, payload: Any) -> None:
        if ctx.attempt == 1:  # the stale attempt: its claim is taken from it meanwhile
            stale_running.set()
            stale_may_return.wait(10)
            return
        live_running.set()
        time.sleep(2.5)  # 2.5 heartbeat timeouts: only renewals keep the lease alive
        row = _row(database_url, schema, ctx.row_id)
        live_lease.append(row["lease_left"] if row else -1.0)

    cmd = _handler(d, fam, handler)
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c1] = _claim(d, fam)
    results: list[Outcome] = []
    t1 = threading.Thread(
        target=lambda: results.append(d.delivery.deliver(c1.id, c1.token, family_hint=fam).outcome)
    )
    t1.start()
    assert stale_running.wait(5)
    with psycopg.connect(database_url, autocommit=True) as conn:  # it stalls past its lease
        conn.execute(
            f"UPDATE \"{schema}\".outbox SET due_at = now() - interval '1 s' WHERE id = %s",
            (row_id,),
        )
    [c2] = _claim(d, fam)
    t2 = threading.Thread(
        target=lambda: results.append(d.delivery.deliver(c2.id, c2.token, family_hint=fam).outcome)
    )
    t2.start()
    assert live_running.wait(5)
    stale_may_return.set()  # the stale attempt ends while the live one runs
    t1.join(10)
    t2.join(10)
    assert live_lease and live_lease[0] > 0, "the live attempt's lease was not renewed"
    assert sorted(results) == sorted([Outcome.DELIVERED, Outcome.LOST])
    assert count_rows(database_url, schema, f"id = {row_id}") == 0


# -- 9. recovery at the defaults ---------------------------------------------------------------


def test_a_started_row_of_a_dead_worker_is_due_after_the_heartbeat_timeout_not_the_lease(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    """The built-in ``job`` family at its defaults (lease 300 s, heartbeat timeout 30 s): a
    claimed message may wait five minutes in the queue, a started attempt only 30 s without
    a heartbeat."""
    running, release = threading.Event(), threading.Event()

    def handler(ctx: Context, payload: Any) -> None:
        running.set()
        release.wait(10)

    cmd = _handler(d, "job", handler)
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, "job")
    claimed = _row(database_url, schema, row_id)
    assert claimed is not None and 290 < claimed["lease_left"] <= 300  # queue wait: the lease
    t = threading.Thread(target=lambda: d.delivery.deliver(c.id, c.token, family_hint="job"))
    t.start()
    try:
        assert running.wait(5)
        started = _row(database_url, schema, row_id)
        assert started is not None and 25 < started["lease_left"] <= 30  # running: the timeout
    finally:
        release.set()
        t.join(10)


def test_a_dead_workers_started_row_runs_again_when_the_clock_passes_the_heartbeat_timeout(
    d: Dispatcher, database_url: str
) -> None:
    ran: list[int] = []
    cmd = _handler(d, "job", lambda ctx, p: ran.append(ctx.attempt))
    _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, "job")
    assert d.store.begin(c.id, c.token, d.families["job"].heartbeat_timeout) is not None
    try:
        d.store.clock_offset = 29  # the worker died at once; 29 s later the row is still leased
        assert _claim(d, "job") == []
        d.store.clock_offset = 31
        [again] = _claim(d, "job")
        outcome = d.delivery.deliver(again.id, again.token, family_hint="job").outcome
    finally:
        d.store.clock_offset = 0
    assert outcome is Outcome.DELIVERED and ran == [2]


def test_a_long_transactional_handler_keeps_its_lease_and_leaves_the_pool_to_others(
    database_url: str, schema: str, redis_url: str, key_prefix: str
) -> None:
    """With a pool of one connection, a transactional handler running past its heartbeat
    timeout still has its lease renewed (its transaction is on a connection of its own), so
    no claim takes its row meanwhile."""
    app = Celery("inv_pool", broker="memory://", set_as_current=False)
    one = Dispatcher(app, database_url=database_url, schema=schema, pool_size=1, listen=False)
    try:
        fam = _name("txpool")
        one.family(fam, lease=10, heartbeat_timeout=1.0)
        stolen: list[int] = []

        def handler(ctx: Context, payload: Any) -> None:
            ctx.conn.execute("SELECT 1")
            for _ in range(5):  # 2.5 heartbeat timeouts, claiming meanwhile
                time.sleep(0.5)
                stolen.extend(c.id for c in _claim(one, fam))

        cmd = _handler(one, fam, handler, transactional=True)
        [row_id] = _enqueue(one, database_url, [Message(cmd, {})])
        [c] = _claim(one, fam)
        assert one.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.DELIVERED
        assert stolen == []
        assert count_rows(database_url, schema, f"id = {row_id}") == 0
    finally:
        one.close()
