"""Batched delivery: one message names up to `batch` (row id, token) pairs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox_dispatch import Context, Dispatcher, Message, Outcome
from outbox_dispatch.wiring import DELIVER_TASK
from tests.conftest import count_rows

from .conftest import Effects


def test_batched_family_publishes_pairs_and_the_worker_settles_them(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    def flaky(ctx: Context, payload: Any) -> None:
        if payload.get("fail") and ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    cmd = commands(family="bulk", fn=flaky)
    msgs = [Message(cmd, {"n": i, "fail": i == 7, "secret": "s3cr3t"}) for i in range(35)]
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, msgs)
    assert dispatcher.claim_and_publish().claimed == {"bulk": 35}
    deadline = time.monotonic() + 20
    while count_rows(database_url, dispatcher.schema, f"id = ANY(ARRAY{ids})") > 0:
        if time.monotonic() > deadline:
            raise AssertionError("batched rows not delivered")
        dispatcher.claim_and_publish()  # the retried row comes due again
        time.sleep(0.05)
    calls = [r for c, r, _, _ in effects.calls if c == cmd]
    assert sorted(set(calls)) == sorted(ids)
    assert len(calls) == 36  # 35 rows, one of them twice (it failed once)
    messages = [m for m in published if m["task"] == DELIVER_TASK]
    first_pass = messages[:4]
    assert [len(m["body"][0][0]) for m in first_pass] == [10, 10, 10, 5]
    for m in first_pass:
        assert "s3cr3t" not in repr(m["body"])
        assert m["headers"]["shadow"].startswith(f"bulk:{cmd}[")
        assert "rows=[" in m["headers"]["argsrepr"]


def test_drain_delivers_batches_and_settles_failures_one_by_one(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    def fail_odd(ctx: Context, payload: Any) -> None:
        if payload["n"] % 2:
            raise ValueError("odd rows fail")

    cmd = commands(family="bulk", fn=fail_odd)
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(12)])
    report = dispatcher.drain(timeout=10)
    assert report.delivered == 6
    assert report.count(Outcome.RETRIED) == 6


def test_a_worker_dying_mid_batch_marks_the_whole_batch_maybe_applied(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands(family="bulk")
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(3)])
    claimed = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    started = dispatcher.store.begin_many([(c.id, c.token) for c in claimed], run_lease=10)
    assert [s.id for s in started] == ids  # then the worker is killed
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{dispatcher.schema}".outbox SET due_at = now()')
    dispatcher.drain(timeout=10)
    flags = [(c, a) for c, _, a, _ in effects.calls if c == cmd]
    assert flags == [(cmd, 2)] * 3


def test_each_row_of_a_batch_gets_its_own_time_limit(
    dispatcher: Dispatcher, commands: Callable[..., str], conn: psycopg.Connection[Any]
) -> None:
    """Eight 0.4 s handlers in one message of a family with a 1 s limit (2 s hard): each
    row's limit starts with its own handler, so none is told to stop (with one deadline for
    the whole batch, the later rows started already cancelled and lost their leases)."""
    dispatcher.family("slowbatch", batch=8, lease=3, time_limit=1)
    told: list[bool] = []

    def slow(ctx: Context, payload: Any) -> None:
        told.append(ctx.is_cancelled)
        time.sleep(0.4)

    name = commands(family="slowbatch", fn=slow)
    with conn.transaction():
        dispatcher.enqueue_many(conn, [Message(name, {"n": i}) for i in range(8)])
    assert dispatcher.drain(timeout=20).delivered == 8
    assert told == [False] * 8
