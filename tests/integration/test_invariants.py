"""Invariants 11-13 and the defects an adversarial review found (issue 12), each against the
real Postgres and Redis: families that must keep moving, attempts that must not settle as
delivered, caps that must hold where they are declared, and values at the edge of their type.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from psycopg import IsolationLevel

from outbox_dispatch import (
    Context,
    DatabaseError,
    Dispatcher,
    InvalidArgument,
    Message,
    OutboxError,
    Outcome,
)
from outbox_dispatch.caps.semaphore import Slot
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.core.settle import StopReason
from tests.conftest import count_rows

Row = dict[str, Any]


@pytest.fixture(scope="module")
def d(database_url: str, redis_url: str, schema: str, key_prefix: str) -> Iterator[Dispatcher]:
    prefix = f"{key_prefix}inv"
    app = Celery("invariants", broker="memory://", set_as_current=False)
    dispatcher = Dispatcher(
        app,
        database_url=database_url,
        redis_url=redis_url,
        schema=schema,
        key_prefix=prefix,
        listen=False,
    )
    yield dispatcher
    dispatcher.close()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _name(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:6]}"


def _handler(d: Dispatcher, family: str, fn: Callable[[Context, Any], Any], **kw: Any) -> str:
    cmd = f"inv.{uuid.uuid4().hex[:8]}"
    d.handler(cmd, family=family, **kw)(fn)
    return cmd


def _enqueue(d: Dispatcher, database_url: str, msgs: list[Message]) -> list[int]:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return d.enqueue_many(conn, msgs)


def _row(database_url: str, schema: str, row_id: int) -> Row | None:
    with psycopg.connect(database_url) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as c:
        return c.execute(
            f"SELECT *, extract(epoch FROM due_at - now())::float8 AS lease_left "
            f'FROM "{schema}".outbox WHERE id = %s',
            (row_id,),
        ).fetchone()


def _lapse(database_url: str, schema: str, row_id: int) -> None:
    """The row's lease runs out (its holder stopped renewing)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"UPDATE \"{schema}\".outbox SET due_at = now() - interval '1 second' WHERE id = %s",
            (row_id,),
        )


def _claim(d: Dispatcher, family: str) -> list[Claimed]:
    return d.claimer.claim_family(d.families[family]).claimed


def _until_cancelled(
    seconds: float, started: threading.Event | None = None
) -> Callable[[Context, Any], None]:
    """A handler as users write them: works in small steps and stops when told to.
    ``started`` is set when it begins."""

    def handler(ctx: Context, payload: Any) -> None:
        if started is not None:
            started.set()
        deadline = time.monotonic() + seconds
        while not ctx.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)

    return handler


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


def test_a_handler_whose_cap_slot_lapsed_is_told_to_stop_and_retried(
    d: Dispatcher, database_url: str, schema: str, redis_url: str
) -> None:
    fam = _name("slot")
    d.family(fam, per_actor=1, lease=10, heartbeat_timeout=1.5)
    started = threading.Event()
    cmd = _handler(d, fam, _until_cancelled(10, started))
    [row_id] = _enqueue(d, database_url, [Message(cmd, {}, actor="S")])
    [c] = _claim(d, fam)
    assert d.caps is not None
    key = d.caps.key(fam, "S")

    def expire() -> None:
        started.wait(5)
        redis.Redis.from_url(redis_url).delete(key)  # the slot is gone: another row may hold it

    threading.Thread(target=expire).start()
    assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.RETRIED
    row = _row(database_url, schema, row_id)
    assert row is not None and "cap slot lapsed" in row["last_error"] and row["maybe_applied"]


def test_a_young_claims_slot_lost_before_its_start_is_noticed_and_its_handler_stopped(
    d: Dispatcher, database_url: str, schema: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A young claim's row starts without asking Redis (its slot is surely held, unless
    Redis lost it without losing the sentinel: a failover to a replica that missed the
    acquire). The heartbeat's first renewal, a third of the heartbeat timeout later, finds
    the slot gone and tells the handler to stop, as for any slot that lapses while a handler
    runs, and says so in the log."""
    fam = _name("lost")
    d.family(fam, per_actor=1, lease=10, heartbeat_timeout=1.5)
    cmd = _handler(d, fam, _until_cancelled(10))
    [row_id] = _enqueue(d, database_url, [Message(cmd, {}, actor="L")])
    [c] = _claim(d, fam)
    assert d.caps is not None
    redis.Redis.from_url(redis_url).delete(d.caps.key(fam, "L"))  # lost before the start
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.RETRIED
        d.caps.release_settled([], wait=True)  # what the end of a message reads
    assert time.monotonic() - t0 < 5  # stopped by the heartbeat, not the handler's 10 s
    row = _row(database_url, schema, row_id)
    assert row is not None and "cap slot lapsed" in row["last_error"] and row["maybe_applied"]
    stopped = [r for r in caplog.records if r.__dict__.get("action") == "handler_stopped"]
    assert stopped and StopReason.SLOT_LAPSED.value in stopped[0].getMessage()


def test_a_cancel_seen_by_a_handler_that_returns_settles_as_cancelled(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("cancel")
    d.family(fam, lease=10, heartbeat_timeout=1.0)
    started = threading.Event()
    cmd = _handler(d, fam, _until_cancelled(10, started))
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, fam)

    def cancel() -> None:
        started.wait(5)
        with psycopg.connect(database_url) as conn, conn.transaction():
            d.cancel(conn, row_id, reason="not needed")

    threading.Thread(target=cancel).start()
    assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.CANCELLED
    row = _row(database_url, schema, row_id)
    assert row is not None and row["cancelled_at"] is not None


# -- 3. ordered families and snapshot isolation ------------------------------------------------


@pytest.mark.parametrize("level", [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE])
@pytest.mark.parametrize("way", ["enqueue", "enqueue_many", "cancel"])
def test_ordered_rows_under_snapshot_isolation_are_refused_before_anything_is_written(
    d: Dispatcher, database_url: str, schema: str, level: IsolationLevel, way: str
) -> None:
    """Under REPEATABLE READ the caller's snapshot predates the other producer's commit, so
    its head check would see no head and make a second one: refused, with the transaction
    still usable."""
    fam = _name("iso")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    before = _enqueue(d, database_url, [Message(cmd, {}, actor="X")])[0] if way == "cancel" else 0
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = level
        with conn.transaction():
            conn.execute("SELECT 1")  # the snapshot is taken here
            if way != "cancel":  # another producer commits the actor's head after it
                _enqueue(d, database_url, [Message(cmd, {}, actor="X")])
            with pytest.raises(OutboxError, match="READ COMMITTED"):
                if way == "enqueue":
                    d.enqueue(conn, cmd, {}, actor="X")
                elif way == "enqueue_many":
                    d.enqueue_many(conn, [Message(cmd, {}, actor="X")])
                else:
                    d.cancel(conn, before)
            assert conn.execute("SELECT 2").fetchone() == (2,)  # still usable
    heads = count_rows(database_url, schema, f"family = '{fam}' AND NOT blocked")
    assert heads == 1
    assert count_rows(database_url, schema, f"family = '{fam}' AND cancelled_at IS NULL") == 1


def test_ordered_enqueue_at_read_committed_still_waits_behind_the_other_producers_head(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("rc")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        with conn.transaction():
            conn.execute("SELECT 1")
            _enqueue(d, database_url, [Message(cmd, {}, actor="X")])
            d.enqueue(conn, cmd, {}, actor="X")
    assert count_rows(database_url, schema, f"family = '{fam}' AND NOT blocked") == 1
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 1


# -- 5. a caps rebuild restores each live holder for its own lease, and no dead one -----------


def _slot_left_ms(redis_url: str, key: str, token: str) -> float | None:
    client = redis.Redis.from_url(redis_url)
    score = client.zscore(key, token)
    secs, micros = client.time()
    client.close()
    return None if score is None else score - (secs * 1000 + micros // 1000)


def _lose_caps(d: Dispatcher, redis_url: str) -> None:
    assert d.caps is not None
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{d.caps.prefix}:*"):
        client.delete(key)
    client.close()


def test_a_caps_rebuild_gives_each_holder_its_own_lease_and_skips_dead_rows(
    d: Dispatcher, database_url: str, schema: str, redis_url: str
) -> None:
    short, long = _name("rbshort"), _name("rblong")
    d.family(short, per_actor=2, lease=5)
    d.family(long, per_actor=2, lease=300)
    a = _handler(d, short, lambda ctx, p: None)
    b = _handler(d, long, lambda ctx, p: None)
    _enqueue(d, database_url, [Message(a, {}, actor="R"), Message(b, {}, actor="R")])
    [live] = _claim(d, short)
    [dead] = _claim(d, long)
    assert d.store.begin(dead.id, dead.token, 30) is not None  # started, then its worker died
    _lapse(database_url, schema, dead.id)
    _lose_caps(d, redis_url)
    assert d.claimer.rebuild_caps() == 1
    assert d.caps is not None
    left = _slot_left_ms(redis_url, d.caps.key(short, "R"), str(live.token))
    assert left is not None and 0 < left <= 5000  # its own lease, not the longest family's
    assert _slot_left_ms(redis_url, d.caps.key(long, "R"), str(dead.token)) is None


def test_a_row_settled_during_a_caps_rebuild_does_not_come_back_as_a_holder(
    d: Dispatcher, database_url: str, schema: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fam = _name("rbrace")
    d.family(fam, per_actor=1, lease=30)
    cmd = _handler(d, fam, lambda ctx, p: None)
    [row_id] = _enqueue(d, database_url, [Message(cmd, {}, actor="Q")])
    [c] = _claim(d, fam)
    _lose_caps(d, redis_url)
    assert d.caps is not None
    restore = d.caps.restore

    def settle_then_restore(holders: Any) -> None:
        # the row's worker settles between the rebuild's read and its restore: its release
        # finds nothing in Redis yet
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DELETE FROM "{schema}".outbox WHERE id = %s', (row_id,))
        restore(holders)

    monkeypatch.setattr(d.caps, "restore", settle_then_restore)
    d.claimer.rebuild_caps()
    assert _slot_left_ms(redis_url, d.caps.key(fam, "Q"), str(c.token)) is None


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


# -- 7. a command's own cap is its own semaphore ----------------------------------------------


def test_a_commands_own_cap_does_not_wait_behind_another_commands_slots(
    d: Dispatcher, database_url: str, redis_url: str
) -> None:
    fam = _name("percmd")
    d.family(fam, per_actor=2, lease=10)
    any_cmd = _handler(d, fam, lambda ctx, p: None)
    one_cmd = _handler(d, fam, lambda ctx, p: None, per_actor=1)
    msgs = [Message(any_cmd, {}, actor="A")] * 2 + [Message(one_cmd, {}, actor="A")] * 2
    ids = _enqueue(d, database_url, msgs)
    result = d.claimer.claim_family(d.families[fam])
    assert sorted(c.id for c in result.claimed) == ids[:3]  # one row of each cap's room
    assert result.waiting == 1  # the second one_cmd row: its own cap of 1 is taken
    assert d.caps is not None
    assert len(d.caps.holders(fam, "A")) == 2
    assert len(d.caps.holders(fam, "A", one_cmd)) == 1
    _lose_caps(d, redis_url)
    assert d.claimer.rebuild_caps() == 3  # each holder back in its own cap's set
    assert len(d.caps.holders(fam, "A")) == 2
    assert len(d.caps.holders(fam, "A", one_cmd)) == 1


# -- 8. values at the edge of their type -------------------------------------------------------


@pytest.mark.parametrize(
    "delay", [timedelta(days=10**6), timedelta.max, timedelta(days=100 * 366, seconds=1)]
)
def test_an_enormous_delay_is_refused_and_the_callers_transaction_stays_usable(
    d: Dispatcher, database_url: str, schema: str, delay: timedelta
) -> None:
    cmd = _handler(d, "intent", lambda ctx, p: None)
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(InvalidArgument, match="delay must be at most"):
            d.enqueue(conn, cmd, {}, delay=delay)
        with pytest.raises(InvalidArgument, match="delay must be at most"):
            d.enqueue_many(conn, [Message(cmd, {}, delay=delay)])
        assert conn.execute("SELECT 1").fetchone() == (1,)
        d.enqueue(conn, cmd, {}, delay=timedelta(days=100 * 365))  # the longest allowed works
    assert count_rows(database_url, schema) == 1


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


@pytest.mark.parametrize("bad", [math.nan, -1.0, 1e300, timedelta(days=-1)])
def test_a_retention_out_of_range_is_refused_when_the_family_is_declared(
    d: Dispatcher, bad: float | timedelta
) -> None:
    with pytest.raises(OutboxError, match="retention"):
        d.family(_name("badkeep"), retention=bad)


@pytest.mark.parametrize(
    "option", [{"lease": 1e300}, {"lease": math.nan}, {"time_limit": 1e300}, {"lease": 0.5}]
)
def test_intervals_past_what_postgres_can_add_are_refused_at_declaration(
    d: Dispatcher, option: dict[str, Any]
) -> None:
    with pytest.raises(OutboxError):
        d.family(_name("badlease"), **option)


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


# -- also: waiting rows, families that stop being ordered, transactional handlers' connections


def test_a_row_set_waiting_loses_its_lapsed_claim(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    """A lapsed, never-started claim ends when its row is set waiting: no stalled worker can
    renew or settle the waiting row, and its attempt is not counted twice."""
    fam = _name("wait")
    d.family(fam, per_actor=1, lease=30)
    cmd = _handler(d, fam, lambda ctx, p: None)
    first, second = _enqueue(d, database_url, [Message(cmd, {}, actor="W")] * 2)
    claimed = d.claimer.claim_family(d.families[fam])
    assert [c.id for c in claimed.claimed] == [first] and claimed.waiting == 1
    [c] = claimed.claimed
    assert d.caps is not None
    d.caps.release_many([Slot(fam, "W", c.token, 1)])  # it expired with the lost message
    with psycopg.connect(database_url, autocommit=True) as conn:
        # the first row's claim lapsed; the second row came due before it
        conn.execute(
            f'UPDATE "{schema}".outbox SET due_at = now() - CASE WHEN id = %s '
            "THEN interval '1 s' ELSE interval '2 s' END WHERE id IN (%s, %s)",
            (first, first, second),
        )
    again = d.claimer.claim_family(d.families[fam])
    assert [r.id for r in again.claimed] == [second] and again.waiting == 1
    row = _row(database_url, schema, first)
    assert row is not None and row["waiting"] and row["claim_token"] is None
    assert row["attempts"] == 0  # the claim that never started gave its attempt back
    assert d.store.renew([(c.id, c.token, None)], 30) == {}  # a stalled holder renews nothing


def test_rows_blocked_in_a_family_that_is_no_longer_ordered_become_due(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("wasline")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    ids = _enqueue(d, database_url, [Message(cmd, {}, actor="U")] * 3)
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 2
    d.family(fam)  # redeclared without ordering
    d.ops.prune()
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 0
    assert sorted(c.id for c in _claim(d, fam)) == ids


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
