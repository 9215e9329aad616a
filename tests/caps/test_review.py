"""Caps that must hold where they are declared (invariant 12 and issue 12's review), against the
real Postgres and Redis: a handler whose cap slot lapsed, or was lost before its start, is
told to stop and retried; a caps rebuild restores each live holder for its own lease and no
dead or settled one; a command's own cap is a semaphore of its own; a row set waiting loses
its lapsed claim."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
import redis

from outbox_dispatch import Dispatcher, Message, Outcome
from outbox_dispatch.caps.semaphore import Slot
from outbox_dispatch.core.settle import StopReason
from tests.support.review import (
    _claim,
    _enqueue,
    _handler,
    _lapse,
    _name,
    _row,
    _until_cancelled,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


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
