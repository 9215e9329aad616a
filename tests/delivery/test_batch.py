"""Batched delivery: a claim that finds a backlog packs several (row id, token) pairs into one
message, sized per claim; at low load each row has a message of its own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher, Message, Outcome
from outbox_dispatch.celery.wiring import DELIVER_TASKS
from outbox_dispatch.claim.claimer import Claimer, ClaimReport
from outbox_dispatch.core import timings
from outbox_dispatch.core.policy import SPREAD
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects, wait_for

pytestmark = pytest.mark.usefixtures("clean")


def _deliveries(published: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in published if m["task"] in DELIVER_TASKS]


def _rows_in(message: dict[str, Any]) -> int:
    args = message["body"][0]
    return len(args[0]) if len(args) == 1 else 1


def _clear_run_stats(database_url: str, schema: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox_run_stats')


def test_a_lone_row_of_the_default_family_gets_a_message_of_its_own(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    published: list[dict[str, Any]],
) -> None:
    cmd = commands(family="plain")
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {"n": 1}, actor="a-1")
    assert dispatcher.runtime.claim_and_publish(["plain"]).claimed == {"plain": 1}
    [message] = _deliveries(published)
    assert message["body"][0][0] == row_id and len(message["body"][0]) == 2
    assert message["headers"]["shadow"] == f"plain:{cmd}"  # Flower's name for it
    assert message["headers"]["argsrepr"] == f"(row={row_id}, actor='a-1', attempt=1)"


def test_a_backlog_is_packed_over_the_consumers_and_every_row_is_delivered_once(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    schema: str,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    _clear_run_stats(database_url, schema)
    # the sizing counts the messages waiting in the queue: the one an earlier test left there
    # (its row gone) goes to the worker first
    plain = dispatcher.families["plain"]
    wait_for(lambda: dispatcher.runtime.queues.length(plain) == 0, "the plain queue drained")
    time.sleep(timings.QUEUE_TTL)  # and no claim reuses a length read before
    cmd = commands(family="plain")
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(400)])
    assert dispatcher.runtime.claim_and_publish(["plain"]).claimed == {"plain": 400}
    messages = _deliveries(published)
    sizes = [_rows_in(m) for m in messages]
    consumers = dispatcher.runtime.consumers()
    assert sum(sizes) == 400
    # spread over SPREAD (4) messages per consumer, no more than 100 rows each
    assert len(messages) == 4 * consumers and max(sizes) <= 100
    assert all(
        m["headers"]["shadow"] == f"plain:{cmd}[{n}]" for m, n in zip(messages, sizes, strict=True)
    )
    deadline = time.monotonic() + 30
    while count_rows(database_url, schema, f"id = ANY(ARRAY{ids})") > 0:
        assert time.monotonic() < deadline, "batched rows not delivered"
        time.sleep(0.05)
    assert sorted(effects.rows(cmd)) == sorted(ids)  # each exactly once


def test_a_listener_leaves_a_trickle_to_one_claim_that_packs_it_while_the_queue_is_busy(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """One-row commits that arrive while the family's queue holds work for every consumer
    stay due in Postgres (the listener claims again within its refill interval); once the
    queue drains, one claim takes them all and packs them. Beat's pass, which comes back only
    after its interval, claims whatever the queue holds."""
    _clear_run_stats(database_url, schema)
    cmd = commands(family="plain")
    queued = [2 * SPREAD]  # two consumers, each with SPREAD messages waiting
    claimer = Claimer(
        dispatcher.store,
        {"plain": dispatcher.families["plain"]},
        consumers=lambda: 2,
        queued=lambda family: queued[0],
    )
    sent: list[tuple[list[int], int]] = []

    def run(refills: bool) -> ClaimReport:
        return claimer.run(
            lambda f, rows, size: sent.append(([r.id for r in rows], size)), refills=refills
        )

    def due() -> int:
        return count_rows(database_url, schema, f"command = '{cmd}' AND claim_token IS NULL")

    ids: list[int] = []
    for n in range(10):  # one transaction per row, as a stream of commits
        with psycopg.connect(database_url) as conn, conn.transaction():
            ids.append(dispatcher.enqueue(conn, cmd, {"n": n}))
        report = run(refills=True)
        assert (report.claimed, report.saturated, sent) == ({}, {"plain"}, [])
    assert due() == 10
    queued[0] = 2 * SPREAD - 1  # a consumer took a message: room for more
    report = run(refills=True)
    assert report.claimed == {"plain": 10} and due() == 0
    # one claim, packed over the messages the queue lacks (at least one per consumer)
    assert sent == [(ids, 5)]
    with psycopg.connect(database_url) as conn, conn.transaction():
        late = dispatcher.enqueue(conn, cmd, {"n": 10})
    queued[0] = 100  # busy, with broker room: beat's pass claims
    assert run(refills=False).claimed == {"plain": 1} and sent[-1] == ([late], 1)


def test_the_commit_listener_leaves_rows_to_a_busy_queue(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clear_run_stats(database_url, schema)
    cmd = commands(family="plain")
    busy = dispatcher.runtime.consumers() * SPREAD  # messages waiting: work for every consumer
    monkeypatch.setattr(dispatcher.runtime.queues, "queued", lambda family: busy)
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue(conn, cmd, {"n": 1})
    report = dispatcher.runtime.commit_listener().claim(["plain"])  # what a listener runs
    assert (report.claimed, report.saturated) == ({}, {"plain"})
    assert count_rows(database_url, schema, f"command = '{cmd}' AND claim_token IS NULL") == 1


def test_message_size_follows_the_measured_run_time_and_the_queue(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """Handlers that take 0.5 s on a 10 s lease: a tenth of the lease fits 2 rows per message,
    however big the backlog; handlers measured by two more processes count as consumers."""
    _clear_run_stats(database_url, schema)
    fam = dispatcher.family("slowish", lease=10)
    claimer = dispatcher.claimer
    assert claimer.message_size(fam, 1) == 1
    local = dispatcher.runtime.consumers()
    assert claimer.message_size(fam, 400) == min(100, -(-400 // (4 * local)))
    for process in ("host-a:1", "host-b:2", "host-c:3"):
        dispatcher.store.report_run_time("slowish", process, 0.5)
    claimer.run_stats._read_at = -1e9  # type: ignore[union-attr]  # read the reports now
    assert claimer.message_size(fam, 400) == 2
    assert claimer.message_size(dispatcher.family("slowish", lease=100), 400) == 20
    pinned = dispatcher.family("slowish", batch=1)
    assert claimer.message_size(pinned, 400) == 1


def test_each_row_of_a_batch_starts_settles_and_retries_on_its_own(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    def fail_odd(ctx: Context, payload: Any) -> None:
        if payload["n"] % 2:
            raise ValueError("odd rows fail")

    cmd = commands(family="bulk", fn=fail_odd)
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(12)])
    claimed = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    results = dispatcher.delivery.deliver_batch(
        [(c.id, c.token) for c in claimed], family_hint="bulk"
    )
    assert [r.outcome for r in results] == [Outcome.DELIVERED, Outcome.RETRIED] * 6


def test_rows_after_the_one_that_was_running_are_not_marked_started(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """A process that dies in a batch's third handler: the third row is the only one marked
    started (it runs again with maybe_applied); the ones after it never began. The process
    kill itself is tested in tests/delivery/test_batch_processes.py."""

    class Killed(BaseException):
        pass

    def die_on_third(ctx: Context, payload: Any) -> None:
        if payload["n"] == 2 and ctx.attempt == 1:
            raise Killed()

    cmd = commands(family="bulk", fn=die_on_third)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(6)])
    claimed = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    with contextlib.suppress(Killed):
        dispatcher.delivery.deliver_batch([(c.id, c.token) for c in claimed], family_hint="bulk")
    with psycopg.connect(database_url) as conn:
        started = {
            r[0]: r[1]
            for r in conn.execute(
                f'SELECT id, started_at IS NOT NULL FROM "{schema}".outbox WHERE id = ANY(%s)',
                (ids,),
            )
        }
    assert started == {ids[2]: True, ids[3]: False, ids[4]: False, ids[5]: False}


def test_rows_of_a_batch_whose_time_limit_passed_are_given_back_unstarted(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """Celery's soft limit for a batched message covers all its rows; once it has passed
    (a row before ran long, and caught the limit's exception), the rows after it do not start
    (their handlers would run after the limit, and be retried as stopped): they are due again
    at once, their attempt uncounted, for the next claim."""
    ran: list[int] = []
    cmd = commands(family="bulk", fn=lambda ctx, payload: ran.append(payload["n"]))
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(3)])
    claimed = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    claimed = [c for c in claimed if c.id in ids]
    assert sorted(c.id for c in claimed) == ids
    results = dispatcher.delivery.deliver_batch(
        [(c.id, c.token) for c in claimed], family_hint="bulk", stop_at=time.monotonic() - 1
    )
    assert [r.outcome for r in results] == [Outcome.STALE] * 3 and ran == []
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            f'SELECT attempts, started_at IS NULL, due_at <= now() FROM "{schema}".outbox'
            " WHERE id = ANY(%s)",
            (ids,),
        ).fetchall()
    assert rows == [(1, True, True)] * 3  # due now; the claim's attempt is not counted again
    again = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    again = [c for c in again if c.id in ids]
    assert sorted(c.id for c in again) == ids
    assert {c.attempts for c in again} == {1}  # the given-back claim never ran
    for c in again:
        dispatcher.delivery.deliver(c.id, c.token, family_hint="bulk")
    assert sorted(ran) == [0, 1, 2]


def test_each_row_of_a_batch_gets_its_own_time_limit(
    dispatcher: Dispatcher, commands: Callable[..., str], conn: psycopg.Connection[Any]
) -> None:
    """Eight 0.4 s handlers in one message of a family with a 1 s limit: each row's limit
    starts with its own handler, so none is told to stop; a 1.5 s one in the same message is
    told to stop at its own limit and retried."""
    dispatcher.family("slowbatch", batch=9, lease=30, time_limit=1)
    told: list[bool] = []

    def slow(ctx: Context, payload: Any) -> None:
        if payload.get("long"):
            time.sleep(1.5)
        else:
            told.append(bool(ctx.is_cancelled))
            time.sleep(0.4)

    name = commands(family="slowbatch", fn=slow)
    with conn.transaction():
        dispatcher.enqueue_many(conn, [Message(name, {"n": i, "long": i == 4}) for i in range(9)])
    claimed = dispatcher.claimer.claim_family(dispatcher.families["slowbatch"]).claimed
    results = dispatcher.delivery.deliver_batch(
        [(c.id, c.token) for c in claimed], family_hint="slowbatch"
    )
    outcomes = [r.outcome for r in results]
    assert outcomes == [Outcome.DELIVERED] * 4 + [Outcome.RETRIED] + [Outcome.DELIVERED] * 4
    assert "time_limit of 1 s" in results[4].detail
    assert told == [False] * 8


def test_a_capped_family_batches_and_keeps_its_cap(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    schema: str,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    """Cap 2 over 5 actors, 60 rows: the claim packs the rows it may take into messages, and
    no actor ever has more than 2 running."""
    running: dict[str, int] = {}
    most: dict[str, int] = {}

    def track(ctx: Context, payload: Any) -> None:
        assert ctx.actor is not None
        running[ctx.actor] = running.get(ctx.actor, 0) + 1
        most[ctx.actor] = max(most.get(ctx.actor, 0), running[ctx.actor])
        time.sleep(0.01)
        running[ctx.actor] -= 1

    cmd = commands(family="cappedbatch", fn=track)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(
            conn, [Message(cmd, {"n": i}, actor=f"a{i % 5}") for i in range(60)]
        )
    deadline = time.monotonic() + 30
    while count_rows(database_url, schema, f"id = ANY(ARRAY{ids})") > 0:
        assert time.monotonic() < deadline, "capped rows not delivered"
        dispatcher.runtime.claim_and_publish(["cappedbatch"])
        time.sleep(0.05)
    assert max(most.values()) <= 2
    assert any(_rows_in(m) > 1 for m in _deliveries(published))


class _WorkerDied(BaseException):
    """A pool process killed inside a handler: nothing after it runs in that process."""


def test_a_redelivered_batch_does_not_extend_the_slot_of_a_row_whose_worker_died(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A batched message is redelivered after its worker died inside one of its rows: that
    row's start is refused (the attempt started; its lease decides), and the redelivery must
    leave its cap slot as that start left it, not extend it past the row's lease, where it
    would keep the actor's cap taken after the row is due again (found by the model test: a
    slot alive after its row's lease ran out)."""
    caps = dispatcher.caps
    assert caps is not None
    actor = f"d{time.monotonic_ns()}"

    def dies(ctx: Context, payload: Any) -> None:
        if payload.get("dies"):
            raise _WorkerDied()

    cmd = commands(family="cappedbatch", fn=dies)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(
            conn, [Message(cmd, {"dies": True}, actor=actor), Message(cmd, {}, actor=actor)]
        )
    claimed = dispatcher.claimer.claim_family(dispatcher.families["cappedbatch"]).claimed
    pairs = [(c.id, c.token) for c in claimed if c.id in ids]
    assert [i for i, _ in pairs] == ids
    with contextlib.suppress(_WorkerDied):
        dispatcher.delivery.deliver_batch(pairs, family_hint="cappedbatch", defer=True)
    dispatcher.delivery.deferred.take()  # the process died with what it had not settled
    key, dead = caps.key("cappedbatch", actor), str(pairs[0][1])
    before = caps.client.zscore(key, dead)
    assert before is not None  # the claim's slot: its young start wrote nothing to Redis
    time.sleep(0.3)
    results = dispatcher.delivery.deliver_batch(pairs, family_hint="cappedbatch", defer=True)
    assert results[0].outcome is Outcome.STALE  # started before: its lease decides
    assert results[1].outcome is Outcome.DELIVERED
    assert caps.client.zscore(key, dead) == before  # not extended by the redelivery


def test_a_capped_batch_gives_each_slot_back_when_its_handler_returns(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a batched message of capped rows, each row's cap slot goes back when its handler
    returns (a cap counts running handlers), written at once without waiting for Redis's
    answer, and its settle is carried by the next row's start. The last row is settled at the
    message's end; the freed slots let an actor's waiting row in."""
    caps = dispatcher.caps
    assert caps is not None
    actors = [f"r{time.monotonic_ns()}", f"s{time.monotonic_ns()}"]
    seen: list[tuple[int, int]] = []  # (rows of the message left, slots held) at each start

    def held() -> int:
        """Slots of the message's rows still held (the session worker may run a claim task
        that a freed slot asked for, and give the waiting row a slot of its own meanwhile)."""
        mine = {str(c.token) for c in claimed}
        return sum(len(mine.intersection(caps.holders("cappedbatch", a))) for a in actors)

    def look(ctx: Context, payload: Any) -> None:
        if ctx.row_id not in ids:  # the waiting row, which the session worker may run meanwhile
            return
        left = count_rows(database_url, schema, f"id = ANY(ARRAY{ids})")
        seen.append((left, held()))

    cmd = commands(family="cappedbatch", fn=look)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {}, actor=a) for a in actors * 2])
        waiting = dispatcher.enqueue(conn, cmd, {}, actor=actors[0])
    family = dispatcher.families["cappedbatch"]
    claimed = [c for c in dispatcher.claimer.claim_family(family).claimed if c.id in ids]
    assert len(claimed) == 4  # cap 2 per actor: the fifth row waits
    calls: list[int] = []
    statements: list[int] = []
    real, settle_many = caps.release_settled, dispatcher.store.settle_many

    ours = {c.token for c in claimed}  # the session worker may settle other rows meanwhile

    def release_settled(slots: Any, database: Any = None, *, wait: bool = True) -> Any:
        if n := sum(s.token in ours for s in slots):
            calls.append(n)
        return real(slots, database, wait=wait)

    def counted_settle_many(kind: Any, pairs: Any) -> set[int]:
        if n := sum(token in ours for _, token in pairs):
            statements.append(n)
        return settle_many(kind, pairs)

    caps.release_settled = release_settled  # type: ignore[method-assign]
    dispatcher.store.settle_many = counted_settle_many  # type: ignore[method-assign]
    # the thread leaves what no start carried to the batch's end
    monkeypatch.setattr("outbox_dispatch.core.timings.SETTLE_WINDOW", 5.0)
    try:
        results = dispatcher.delivery.deliver_batch(
            [(c.id, c.token) for c in claimed], family_hint="cappedbatch", defer=True
        )
    finally:
        del caps.release_settled, dispatcher.store.settle_many
    assert [r.outcome for r in results] == [Outcome.DELIVERED] * 4
    assert seen == [(4, 4), (3, 3), (2, 2), (1, 1)]  # freed and settled before the next start
    assert statements == [1]  # the last row, at the message's end
    assert calls == [1, 1, 1, 1]
    assert held() == 0
    # the waiting row gets a freed slot at the next claim (or the session worker's)
    deadline = time.monotonic() + 10
    while count_rows(database_url, schema, f"id = {waiting} AND claim_token IS NULL"):
        assert time.monotonic() < deadline, "the waiting row never got a freed slot"
        dispatcher.claimer.claim_family(family)
        time.sleep(0.05)
