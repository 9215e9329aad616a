"""Settling an attempt: retries with backoff, parking (attempts run out, a permanent failure,
a command without a handler), a lost attempt's maybe_applied, and the deferred settles that a
worker's next start carries, fenced by the token each row was delivered under."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Backoff, Context, Dispatcher, Message, Outcome, PermanentFailure
from outbox_dispatch.core.settle import SettleKind
from outbox_dispatch.ops.cli import main as cli_main
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects
from tests.support.delivery import _claim_one, _enqueue, _row

pytestmark = pytest.mark.usefixtures("clean")


def _drain_until_settled(dispatcher: Dispatcher, row_id: int, database_url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        dispatcher.drain(timeout=5)
        n = count_rows(database_url, dispatcher.schema, f"id = {row_id} AND parked_at IS NULL")
        if n == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"row {row_id} did not settle")


def test_backoff_then_parked_with_error_then_retry_delivers(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fail = {"on": True}

    def flaky(ctx: Context, payload: Any) -> None:
        if fail["on"]:
            raise ConnectionError(f"provider down (attempt {ctx.attempt})")

    # 3 attempts; a backoff long enough that a slow machine's drain never reaches the retry
    dispatcher.family("steady", max_attempts=3, lease=5, backoff=Backoff(0.5, 0.5, 0.0))
    cmd = commands(family="steady", fn=flaky)
    row_id = _enqueue(dispatcher, database_url, cmd)

    first = dispatcher.drain(timeout=5)
    assert first.count(Outcome.RETRIED) == 1
    row = _row(database_url, dispatcher.schema, row_id)
    assert (
        row["attempts"] == 1 and row["last_error"] == "ConnectionError: provider down (attempt 1)"
    )
    assert row["claim_token"] is None and row["parked_at"] is None
    with psycopg.connect(database_url) as conn:
        wait = conn.execute(
            f'SELECT extract(epoch FROM due_at - now()) FROM "{dispatcher.schema}".outbox'
        ).fetchone()
    assert wait is not None and 0 < float(wait[0]) <= 0.5

    _drain_until_settled(dispatcher, row_id, database_url)
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["parked_at"] is not None
    assert row["attempts"] == 3
    assert row["last_error"] == "ConnectionError: provider down (attempt 3)"
    assert [a for c, _, a, _ in effects.calls if c == cmd] == [1, 2, 3]

    # the CLI shows it and brings it back; attempts start over
    spec = "tests.support.app_ref:dispatcher"
    monkeypatch.setattr("tests.support.app_ref.dispatcher", dispatcher, raising=False)
    assert cli_main(["--app", spec, "parked", "list"]) == 0
    assert "provider down (attempt 3)" in capsys.readouterr().out
    fail["on"] = False
    assert cli_main(["--app", spec, "parked", "retry", str(row_id)]) == 0
    assert "1 row due again" in capsys.readouterr().out
    assert dispatcher.drain(timeout=5).delivered == 1
    assert count_rows(database_url, dispatcher.schema) == 0
    assert [a for c, _, a, _ in effects.calls if c == cmd][-1] == 1


def test_permanent_failure_parks_at_once(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    def reject(ctx: Context, payload: Any) -> None:
        raise PermanentFailure("payload fails the schema: 'email' is required")

    row_id = _enqueue(dispatcher, database_url, commands(fn=reject))
    assert dispatcher.drain(timeout=5).count(Outcome.PARKED) == 1
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["attempts"] == 1 and "'email' is required" in row["last_error"]


def test_command_without_handler_at_delivery_is_parked(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = f"t.producer_only.{uuid.uuid4().hex[:6]}"
    dispatcher.declare(cmd, family="intent")  # known to the producer, no handler here
    row_id = _enqueue(dispatcher, database_url, cmd)
    assert dispatcher.drain(timeout=5).count(Outcome.PARKED) == 1
    row = _row(database_url, dispatcher.schema, row_id)
    assert "no handler for command" in row["last_error"] and row["attempts"] == 1


def test_lost_attempt_sets_maybe_applied_and_a_lost_last_attempt_parks(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    flags: list[bool] = []

    def note(ctx: Context, payload: Any) -> None:
        flags.append(ctx.maybe_applied)

    cmd = commands(family="quick", fn=note)  # max_attempts=3
    row_id = _enqueue(dispatcher, database_url, cmd)
    for _ in range(3):  # three attempts start and die
        _, token = _claim_one(dispatcher, "quick")
        assert dispatcher.store.begin(row_id, token, run_lease=5) is not None
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'UPDATE "{dispatcher.schema}".outbox SET due_at = now()')
    result = dispatcher.claimer.claim_family(dispatcher.families["quick"])
    assert result.claimed == [] and result.parked == [row_id]
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["maybe_applied"] is True and row["attempts"] == 3
    assert "ended without an outcome" in row["last_error"]
    assert flags == []


def _claim(dispatcher: Dispatcher, family: str) -> list[Any]:
    return dispatcher.claimer.claim_family(dispatcher.families[family]).claimed


def test_deferred_settles_ride_on_the_next_start_and_stay_fenced(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's successes cost no round trip of their own: each is settled by the statement
    that starts the next row in the same process; the last, which no start carried, settles
    in the background. A row whose cancel was requested while its handler ran is still
    recorded as cancelled: the next start's fenced settle refuses it, and the one-row path
    records why."""
    schema = dispatcher.schema
    cmd = commands(family="quick")
    cancel_me: dict[str, int] = {}

    def asks_to_cancel_itself(ctx: Context, payload: Any) -> None:
        with psycopg.connect(database_url) as conn, conn.transaction():
            result = dispatcher.cancel(conn, ctx.row_id, reason="changed my mind")
        assert result.requested == [ctx.row_id]  # it is running: a request
        cancel_me["id"] = ctx.row_id

    regretful = commands(family="quick", fn=asks_to_cancel_itself)
    late = _enqueue(dispatcher, database_url, regretful)
    ids = [_enqueue(dispatcher, database_url, cmd, {"n": i}) for i in range(6)]
    statements: list[int] = []
    settle_many = dispatcher.store.settle_many

    def counting(kind: SettleKind, pairs: Any) -> set[int]:
        statements.append(len(pairs))
        return settle_many(kind, pairs)

    dispatcher.store.settle_many = counting  # type: ignore[method-assign]
    monkeypatch.setattr("outbox_dispatch.core.timings.SETTLE_WINDOW", 0.3)  # the thread waits
    try:
        claimed = _claim(dispatcher, "quick")
        assert [c.id for c in claimed] == [late, *ids]
        for c in claimed:
            result = dispatcher.delivery.deliver(c.id, c.token, family_hint="quick", defer=True)
            assert result.outcome is Outcome.DELIVERED
        # the first five were settled by the starts of the rows after them, before the
        # thread's turn; the one whose cancel was asked and the last are left
        assert count_rows(database_url, schema) == 2
        assert statements == []
        deadline = time.monotonic() + 5
        while count_rows(database_url, schema) > 1:
            assert time.monotonic() < deadline, "deferred settles never landed"
            time.sleep(0.01)
    finally:
        del dispatcher.store.settle_many
    assert _row(database_url, schema, late)["cancel_reason"] == "changed my mind"
    assert statements == [1]  # the last row, settled by the thread


def test_the_settles_thread_is_not_woken_for_each_row_of_a_steady_flow(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows delivered one after another leave the background thread nothing to do: each
    start carries the settle of the row before it. Waking the thread for each row anyway
    (it had gone idle while a start held the last row) cost two switches of the GIL a row,
    a quarter of a batched row's CPU. It is woken by the first row, then looks again once per
    SETTLE_WINDOW (20 ms; the 100 rows take more than that) while rows keep coming, and every row
    is still settled."""
    cmd = commands(family="quick")
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(100)])
    deferred = dispatcher.delivery.deferred
    deferred.flush()
    wakes: list[float] = []
    wake_set = deferred._wake.set

    def counted() -> None:
        wakes.append(time.monotonic())
        wake_set()

    monkeypatch.setattr(deferred._wake, "set", counted)
    for c in _claim(dispatcher, "quick"):
        result = dispatcher.delivery.deliver(c.id, c.token, family_hint="quick", defer=True)
        assert result.outcome is Outcome.DELIVERED
    assert len(wakes) <= 25, f"the settles' thread was woken {len(wakes)} times for 100 rows"
    deferred.flush()
    assert count_rows(database_url, dispatcher.schema) == 0


def test_a_flush_waits_for_the_settles_the_thread_has_in_flight(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A flush (the end of a batched message, the worker's shutdown) promises every row
    handed to the deferred settles is settled when it returns. The background thread may have
    taken a row and be settling it right then: the flush must wait for that statement, not
    return at once because nothing is pending (at shutdown the process would exit
    mid-statement, and the row would run again after its lease)."""
    schema = dispatcher.schema
    cmd = commands(family="quick")
    row_id = _enqueue(dispatcher, database_url, cmd)
    in_flight, release = threading.Event(), threading.Event()
    settle_many = dispatcher.store.settle_many

    def slow_in_the_thread(kind: SettleKind, pairs: Any) -> set[int]:
        if threading.current_thread().name == "outbox-settler" and not in_flight.is_set():
            in_flight.set()
            release.wait(10)  # the thread's statement, still on its way
        return settle_many(kind, pairs)

    dispatcher.store.settle_many = slow_in_the_thread  # type: ignore[method-assign]
    flushed = threading.Event()
    try:
        [c] = _claim(dispatcher, "quick")
        result = dispatcher.delivery.deliver(c.id, c.token, family_hint="quick", defer=True)
        assert result.outcome is Outcome.DELIVERED
        assert in_flight.wait(5), "the thread never took the row"

        def flush() -> None:  # the end of a batched message, or the worker's shutdown
            dispatcher.delivery.deferred.flush()
            flushed.set()

        threading.Thread(target=flush).start()
        assert not flushed.wait(0.3), "the flush returned with the thread's settle in flight"
        release.set()
        assert flushed.wait(5)
        assert count_rows(database_url, schema, f"id = {row_id}") == 0  # settled by then
    finally:
        release.set()
        del dispatcher.store.settle_many


def test_one_refused_settle_that_cannot_be_recorded_does_not_drop_the_others(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two delivered rows asked to be cancelled while their handlers ran, so their deferred
    settles are refused and go to the one-row path, which records them as cancelled. If
    recording the first fails (Postgres went away for that statement), the second is still
    recorded: the failure once ended the loop and the rest of the list was dropped."""
    schema = dispatcher.schema
    monkeypatch.setattr("outbox_dispatch.core.timings.SETTLE_WINDOW", 60.0)  # the flush settles

    def asks_to_cancel_itself(ctx: Context, payload: Any) -> None:
        with psycopg.connect(database_url) as conn, conn.transaction():
            assert dispatcher.cancel(conn, ctx.row_id, reason="undo").requested == [ctx.row_id]

    cmd = commands(family="quick", fn=asks_to_cancel_itself)
    ids = [_enqueue(dispatcher, database_url, cmd, {"n": i}) for i in range(2)]
    deferred = dispatcher.delivery.deferred
    record = deferred.refused
    failed: list[int] = []

    def first_fails(kind: SettleKind, started: Any) -> None:
        if not failed:
            failed.append(started.id)
            raise psycopg.OperationalError("connection lost for this statement")
        record(kind, started)

    deferred.refused = first_fails
    try:
        for c in _claim(dispatcher, "quick"):
            result = dispatcher.delivery.deliver(c.id, c.token, family_hint="quick", defer=True)
            assert result.outcome is Outcome.DELIVERED
        deferred.flush()
    finally:
        deferred.refused = record
    [other] = [i for i in ids if i not in failed]
    assert _row(database_url, schema, other)["cancel_reason"] == "undo"
    assert _row(database_url, schema, failed[0])["cancelled_at"] is None  # left to its lease


def test_a_carried_settle_is_fenced_by_the_token_it_was_delivered_under(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker delivers a row and stalls before anything carries its settle; the row's lease
    runs out and another claim takes it. The start that finally carries the old settle must
    leave the row to its new holder (fenced by the old token), and the attempt is recorded as
    lost, not delivered."""
    schema = dispatcher.schema
    cmd = commands(family="quick")
    monkeypatch.setattr("outbox_dispatch.core.timings.SETTLE_WINDOW", 60.0)  # the thread waits
    first = _enqueue(dispatcher, database_url, cmd)
    [old] = _claim(dispatcher, "quick")
    assert dispatcher.delivery.deliver(old.id, old.token, defer=True).outcome is Outcome.DELIVERED
    dispatcher.store.clock_offset = 120.0  # the stall: past the lease the start gave it
    try:
        later = _enqueue(dispatcher, database_url, cmd)
        claimed = {c.id: c for c in _claim(dispatcher, "quick")}
        assert set(claimed) == {first, later}  # the first again: its attempt was lost
        new = claimed[first]
        with caplog.at_level(logging.WARNING, logger="outbox_dispatch.worker"):
            result = dispatcher.delivery.deliver(later, claimed[later].token, defer=True)
            assert result.outcome is Outcome.DELIVERED
            dispatcher.delivery.deferred.flush()  # what the start refused goes to the one-row path
        row = _row(database_url, schema, first)
        assert row["claim_token"] == new.token  # left to its new holder
        assert row["maybe_applied"]
        assert any("settle_refused" in r.getMessage() for r in caplog.records)
        assert dispatcher.delivery.deliver(first, new.token).outcome is Outcome.DELIVERED
    finally:
        dispatcher.store.clock_offset = 0.0
    assert count_rows(database_url, schema, f"id IN ({first}, {later})") == 0
