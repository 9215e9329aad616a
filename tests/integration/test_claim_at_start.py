"""A start that claims (listener.py, deliver_claim_begin), against the real Postgres and the
session's in-process worker: a commit's NOTIFY names its transaction's first row due now, the
worker's listener hands that row unclaimed to an idle pool process, and the process claims
and starts it in one statement. The claim's rules hold there too: the family's in-flight
limit, a row someone else holds, a row not due, capped families."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher, Message
from outbox_dispatch.handoff import LocalHandoff
from outbox_dispatch.listener import CommitListener, Named
from outbox_dispatch.publisher import CLAIM_AT_START, Wire
from outbox_dispatch.rows import Claimed
from outbox_dispatch.settle import Outcome
from tests.conftest import count_rows
from tests.integration.conftest import dispatcher_under, wait_for


@pytest.fixture
def named_listener(
    dispatcher: Dispatcher, handoff: tuple[LocalHandoff, list[int]]
) -> Iterator[CommitListener]:
    """The dispatcher's commit listener, in this process (the session worker's), with no
    sweep: a row it does not hand over is claimed only when a NOTIFY asks."""
    listener = dispatcher.commit_listener()
    listener.sweep = None
    listener.start()
    try:
        wait_for(listener.leading.is_set, "the listener never took the lead")
        yield listener
    finally:
        listener.stop()


@contextlib.contextmanager
def _own_schema(
    name: str, database_url: str, redis_url: str, fn: Callable[..., None]
) -> Iterator[tuple[Dispatcher, str]]:
    """A dispatcher on a schema of the test's own (``dispatcher_under``), migrated, with the
    family ``quick`` and its command ``t.<name>``; yields it and its schema."""
    with dispatcher_under("", database_url, redis_url, name) as (d, _url):
        d.family("quick", lease=5)
        d.handler(f"t.{name}", family="quick")(fn)
        d.migrate()
        yield d, d.schema


def _notified(conn: psycopg.Connection[Any], count: int) -> list[str]:
    got = [n.payload for n in conn.notifies(timeout=2, stop_after=count)]
    got += [n.payload for n in conn.notifies(timeout=0.2)]  # nothing more came
    return got


def test_a_commits_notify_names_its_first_row_due_now_and_only_that(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    quick, plain = commands(family="quick"), commands(family="plain")
    with psycopg.connect(database_url, autocommit=True) as listen:
        listen.execute(f'LISTEN "{dispatcher.store.channel}"')
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                lone = dispatcher.enqueue(conn, quick, {}, actor="ann")
            assert _notified(listen, 1) == [json.dumps(["quick", lone, quick, "ann"])]

            with conn.transaction():  # a bulk insert: one named row, then its family's name
                first = dispatcher.enqueue(conn, quick, {})
                dispatcher.enqueue(conn, quick, {})
                dispatcher.enqueue(conn, quick, {})
                dispatcher.enqueue(conn, plain, {})
            named = json.dumps(["quick", first, quick, None])
            assert _notified(listen, 3) == [named, "quick", "plain"]

            with conn.transaction():  # a row not due and a rolled-back one name nothing
                dispatcher.enqueue(conn, quick, {}, delay=timedelta(seconds=60))
                with pytest.raises(RuntimeError), conn.transaction():
                    dispatcher.enqueue(conn, quick, {})
                    raise RuntimeError("rolled back")
                kept = dispatcher.enqueue(conn, quick, {})
            assert _notified(listen, 1) == [json.dumps(["quick", kept, quick, None])]

            with conn.transaction():  # a payload that would be long names the family only
                dispatcher.enqueue(conn, quick, {}, actor="é" * 510)  # 1,020 bytes
            assert _notified(listen, 1) == ["quick"]


def test_a_lone_commits_row_is_claimed_and_started_in_one_statement_by_an_idle_process(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    named_listener: CommitListener,
    database_url: str,
) -> None:
    h, sent = handoff
    seen: list[tuple[Any, ...]] = []
    ran = threading.Event()

    def look(ctx: Context, payload: Any) -> None:
        with psycopg.connect(database_url) as c:
            row = c.execute(
                f'SELECT claimed_at = started_at, attempts, claim_token IS NOT NULL FROM "{dispatcher.schema}".outbox WHERE id = %s',  # noqa: E501
                (ctx.row_id,),
            ).fetchone()
        seen.append((ctx.attempt, ctx.maybe_applied, row))
        ran.set()

    cmd = commands(family="quick", fn=look)
    handed = h.handed
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    assert ran.wait(10), "the row was never delivered"
    # claimed and started by the same statement: one transaction's now()
    assert seen == [(1, False, (True, 1, True))]
    wait_for(lambda: count_rows(database_url, dispatcher.schema, f"id = {row_id}") == 0, "kept")
    assert h.handed == handed + 1
    assert sent == []  # nothing went through the broker


def test_a_start_that_claims_keeps_the_familys_in_flight_limit(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    named_listener: CommitListener,
    database_url: str,
) -> None:
    """With max_in_flight=1 and a row claimed elsewhere (another worker's), the next
    commit's row is handed over, finds no room, and stays unclaimed; its start's NOTIFY makes
    the listener claim the family, which waits for room and then runs it, once."""
    family = dispatcher.families["quick"]
    dispatcher.families["quick"] = replace(family, max_in_flight=1)
    spans: dict[int, list[float]] = {}

    def run(ctx: Context, payload: Any) -> None:
        spans.setdefault(ctx.row_id, []).append(time.monotonic())

    try:
        cmd = commands(family="quick", fn=run)
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                first = dispatcher.enqueue(conn, cmd, {}, delay=timedelta(seconds=60))
            with conn.transaction():  # due now, without a NOTIFY: another worker claims it
                conn.execute(
                    f'UPDATE "{dispatcher.schema}".outbox SET due_at = now() WHERE id = %s',
                    (first,),
                )
            elsewhere = dispatcher.database().claimer.claim_family(dispatcher.families["quick"])
            assert [c.id for c in elsewhere.claimed] == [first]
            handed = handoff[0].handed
            with conn.transaction():
                second = dispatcher.enqueue(conn, cmd, {})
        wait_for(lambda: handoff[0].handed > handed, "the second row was never handed over")
        time.sleep(0.5)
        assert second not in spans, "the second row started while the first held the room"
        assert count_rows(database_url, dispatcher.schema, f"id = {second} AND claim_token IS NULL")
        token = elsewhere.claimed[0].token
        delivery = dispatcher.database().delivery
        assert delivery.deliver(first, token, family_hint="quick").outcome is Outcome.DELIVERED
        ended = time.monotonic()
        wait_for(lambda: second in spans, "the second row never ran")
        assert spans[second][0] >= ended
        time.sleep(0.2)
        assert len(spans[first]) == 1 and len(spans[second]) == 1  # each ran once
    finally:
        dispatcher.families["quick"] = family


def test_a_named_row_that_a_claim_holds_is_not_started_and_nothing_changes(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """The claim a hand-over races (beat's, a sweep) took the row first; a row not due yet;
    a capped family's row (its start could not take a cap slot): the start refuses and
    leaves the row as it was."""
    ran: list[int] = []
    quick = commands(family="quick", fn=lambda ctx, p: ran.append(ctx.row_id))
    capped = commands(family="cappedbatch", fn=lambda ctx, p: ran.append(ctx.row_id))
    delivery = dispatcher.database().delivery
    with psycopg.connect(database_url) as conn, conn.transaction():
        held = dispatcher.enqueue(conn, quick, {})
        later = dispatcher.enqueue(conn, quick, {}, delay=timedelta(seconds=60))
        capped_id = dispatcher.enqueue(conn, capped, {}, actor="ann")
    claimed = dispatcher.database().claimer.claim_family(dispatcher.families["quick"])
    assert [c.id for c in claimed.claimed] == [held]

    def state(row_id: int) -> Any:
        with psycopg.connect(database_url) as c:
            return c.execute(
                f'SELECT claim_token, attempts, started_at, due_at FROM "{dispatcher.schema}".outbox WHERE id = %s',  # noqa: E501
                (row_id,),
            ).fetchone()

    for row_id, family in ((held, "quick"), (later, "quick"), (capped_id, "cappedbatch")):
        before = state(row_id)
        result = delivery.deliver(row_id, uuid.uuid4(), family_hint=family, claim=True)
        assert result.outcome is Outcome.STALE, (row_id, result)
        assert state(row_id) == before
    assert ran == []
    # the claim's own message still starts its row
    token = claimed.claimed[0].token
    assert delivery.deliver(held, token, family_hint="quick").outcome is Outcome.DELIVERED
    assert ran == [held]


def test_the_worker_takes_as_many_named_rows_as_it_has_free_processes(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """Named rows are handed over one to each pool process that runs nothing, the first of
    them. The rest are left to a claim: their messages never reach the broker unclaimed."""
    h, sent = handoff
    processes = int(worker.consumer.pool.num_processes)
    assert processes == int(worker.consumer.qos.value) == 4  # the session worker's threads
    family = dispatcher.families["quick"]
    queue = dispatcher.queue_name("quick")

    def hand(n: int) -> int:
        rows = [Claimed(10**9 + i, uuid.uuid4(), "t.none", None, 1) for i in range(n)]
        return dispatcher.publisher.hand_unclaimed(family, rows, queue)

    handed = h.handed
    assert hand(processes + 1) == processes
    wait_for(lambda: h.held() == 0, "the handed messages never finished")
    with _one_row_running(dispatcher, commands, database_url):
        # one process runs the held row: three are free
        handed = h.handed  # the held row's claim may have gone through the hand-off too
        assert hand(processes) == processes - 1
        assert h.handed == handed + processes - 1
        wait_for(lambda: h.held() == 1, "the handed messages never finished")
        assert sent == []


def test_a_claim_leaves_the_rows_its_worker_handed_over_to_their_starts(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More rows named than free processes: the first are handed over, and the claim that
    takes the rest leaves them alone, so each row runs once, from the one message that
    reached it, and no start finds its row claimed by the listener (a stale message)."""
    h, _sent = handoff
    ran: list[tuple[int, int]] = []
    cmd = commands(family="quick", fn=lambda ctx, payload: ran.append((ctx.row_id, ctx.attempt)))
    with _one_row_running(dispatcher, commands, database_url):
        rows = []
        for _ in range(5):  # five commits, each naming its row
            with psycopg.connect(database_url) as conn, conn.transaction():
                row_id = dispatcher.enqueue(conn, cmd, {})
            rows.append(Named("quick", row_id, cmd, None))
        handed = h.handed
        caplog.set_level(logging.DEBUG, logger="outbox_dispatch.delivery")
        hold, dispatcher.claimer.handed.hold = dispatcher.claimer.handed.hold, 30.0
        try:
            assert dispatcher.hand_unclaimed({"quick": rows}) == {"quick"}  # 3 free processes
            assert h.handed == handed + 3
            assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 2}
            wait_for(lambda: len(ran) == 5, "the rows never ran")
        finally:
            dispatcher.claimer.handed.hold = hold
    assert sorted(ran) == sorted((r.id, 1) for r in rows)
    assert not [r for r in caplog.records if "stale_dropped" in r.getMessage()]
    wait_for(lambda: count_rows(database_url, dispatcher.schema) == 0, "rows kept")


def test_a_handed_row_whose_start_never_comes_is_claimed_after_its_hold(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """The hold is short: a row handed over whose message is lost (its process died before
    the start) is claimed by the next claim after it, not left for good."""
    cmd = commands(family="quick")
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    handed = dispatcher.claimer.handed
    handed.add("quick", [row_id])  # as if handed over, and the message lost
    assert dispatcher.claim_and_publish(["quick"]).claimed == {}
    time.sleep(handed.hold)
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
    wait_for(lambda: count_rows(database_url, dispatcher.schema) == 0, "the row never ran")


@contextlib.contextmanager
def _one_row_running(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> Iterator[None]:
    """A row of ``quick`` claimed and running in one of the session worker's threads."""
    running, release = threading.Event(), threading.Event()

    def hold(ctx: Context, payload: Any) -> None:
        running.set()
        release.wait(10)

    cmd = commands(family="quick", fn=hold)
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue(conn, cmd, {})
    try:
        assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
        assert running.wait(10), "the claimed row never ran"
        yield
    finally:
        release.set()


def test_a_named_rows_message_is_the_one_row_message_with_its_start_told_to_claim(
    dispatcher: Dispatcher,
) -> None:
    """What Flower shows is the one-row message's (family:command, row, actor, attempt),
    with the kwarg that tells its start to claim."""
    taken: list[Wire] = []

    class Sink:
        def take(self, queue: str, wires: Any, *, idle: bool = False, feed: Any = None) -> int:
            assert idle and feed is None
            taken.extend(wires)
            return len(wires)

    row = Claimed(7, uuid.uuid4(), "t.shown", "ann", 1)
    dispatcher.publisher.local = Sink()
    try:
        assert dispatcher.publisher.hand_unclaimed(
            dispatcher.families["quick"], [row], dispatcher.queue_name("quick")
        )
    finally:
        dispatcher.publisher.local = None
    (wire,) = taken
    args, kwargs, _embed = json.loads(wire.body)
    assert args == [7, str(row.token)] and kwargs == {CLAIM_AT_START: True}
    assert wire.headers["shadow"] == "quick:t.shown"
    assert wire.headers["argsrepr"] == "(row=7, actor='ann', attempt=1)"
    assert wire.headers["kwargsrepr"] == "{'claim_at_start': True}"


def test_a_start_that_claims_on_a_schema_behind_this_version_says_migrate_and_leaves_the_row(
    database_url: str, redis_url: str
) -> None:
    """A worker of this version against a schema its migrations have not reached (no
    outbox_claim_start: migrations 0008 to 0010): the start fails with SchemaNotReady naming the
    command to run, and the row is as it was, for a claim (which needs no new function) to
    deliver; once migrated, the same start claims and runs it."""
    from outbox_dispatch.errors import SchemaNotReady

    ran: list[int] = []

    def record(ctx: Context, payload: Any) -> None:
        ran.append(ctx.row_id)

    with _own_schema("behind", database_url, redis_url, record) as (d, schema):
        with psycopg.connect(database_url, autocommit=True) as conn:  # as before 0008
            conn.execute(f'DROP FUNCTION "{schema}".outbox_claim_start')
            conn.execute(f'DELETE FROM "{schema}".outbox_migrations WHERE version >= 8')
        with psycopg.connect(database_url) as conn, conn.transaction():
            row_id = d.enqueue(conn, "t.behind", {})
        delivery = d.database().delivery
        message = (row_id, str(uuid.uuid4()))
        with pytest.raises(SchemaNotReady, match="run `outbox-dispatch migrate`"):
            delivery.deliver_message(message, family_hint="quick", claim=True)
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                f'SELECT attempts, claim_token, started_at FROM "{schema}".outbox WHERE id = %s',
                (row_id,),
            ).fetchone()
        assert row == (0, None, None) and ran == []

        assert d.migrate() == [8, 9, 10]
        (result,) = delivery.deliver_message(message, family_hint="quick", claim=True)
        assert result.outcome is Outcome.DELIVERED and ran == [row_id]


def test_a_row_its_start_claimed_is_settled_at_once_not_a_window_later(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deferred settle waits a WINDOW for the next start to carry it. A start that claims
    carries none, and one follows another at low load: the row of such a start is settled
    at once by the thread. Left for a WINDOW, its commit landed on the next row's start under
    a steady rate (at 50 rows/s, the 20 ms WINDOW was the gap between two rows). A row of a
    claimed message still waits for a start to carry it."""
    monkeypatch.setattr("outbox_dispatch.deferred_settles.WINDOW", 60.0)
    cmd = commands(family="quick")
    delivery = dispatcher.database().delivery
    delivery.deferred.flush()
    with psycopg.connect(database_url) as conn, conn.transaction():
        claimed_row = dispatcher.enqueue(conn, cmd, {})
    (c,) = dispatcher.database().claimer.claim_family(dispatcher.families["quick"]).claimed
    assert c.id == claimed_row
    result = delivery.deliver(c.id, c.token, family_hint="quick", defer=True)
    assert result.outcome is Outcome.DELIVERED
    time.sleep(0.3)
    assert count_rows(database_url, dispatcher.schema) == 1  # waits for a start to carry it

    with psycopg.connect(database_url) as conn, conn.transaction():
        named = dispatcher.enqueue(conn, cmd, {})
    result = delivery.deliver(named, uuid.uuid4(), family_hint="quick", defer=True, claim=True)
    assert result.outcome is Outcome.DELIVERED
    # the thread settles it now, and the row that waited with it
    wait_for(lambda: count_rows(database_url, dispatcher.schema) == 0, "never settled", 5)


def test_a_start_that_claims_reads_its_row_by_id_beside_a_due_backlog_without_statistics(
    database_url: str, redis_url: str
) -> None:
    """The start's function (migration 0009) finds its row by the primary key. Migration
    0008's matched the id with the family, due time and state, which the partial index
    outbox_due covers too: on a table without statistics (new, a backlog loaded before
    autovacuum's ANALYZE, autovacuum off) the planner walked every due row of the index for
    the one row, 14 ms a start beside 100,000 due rows, with the family's claim lock held.
    Counted in index tuples read, so no clock is involved."""
    with _own_schema("nostats", database_url, redis_url, lambda c, p: None) as (d, schema):
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'ALTER TABLE "{schema}".outbox SET (autovacuum_enabled = false)')
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                d.enqueue_many(conn, [Message("t.nostats", {}) for _ in range(5000)])
            with conn.transaction():
                named = d.enqueue(conn, "t.nostats", {})
        params = {
            "id": named,
            "token": uuid.uuid4(),
            "run_lease": 30.0,
            "family": "quick",
            "max_in_flight": 1000,
            "lock_name": f"{schema}.test",
            "channel": "unheard",
        }
        query = d.database().store.q["deliver_claim_begin"]
        with psycopg.connect(database_url, autocommit=True) as conn:

            def read_in_outbox_due() -> int:
                conn.execute("SELECT pg_stat_force_next_flush()")  # this session's, at its end
                conn.execute("SELECT pg_stat_clear_snapshot()")
                row = conn.execute(
                    "SELECT idx_tup_read FROM pg_stat_user_indexes"
                    " WHERE schemaname = %s AND indexrelname = 'outbox_due'",
                    (schema,),
                ).fetchone()
                assert row is not None
                return int(row[0])

            before = read_in_outbox_due()
            for _ in range(6):  # before 0010, PL/pgSQL planned the first five for their values
                started = conn.execute(query, params).fetchall()
                conn.execute(
                    f'UPDATE "{schema}".outbox SET claim_token = NULL, attempts = 0,'
                    " started_at = NULL, due_at = now() - interval '1 s' WHERE id = %s",
                    (named,),
                )
                assert [r[1] for r in started] == ["t.nostats"]
            read = read_in_outbox_due() - before
        assert read < 100, f"{read} index tuples of outbox_due read for six starts of one row"


def test_a_new_main_pool_session_warms_the_start_and_changes_nothing(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, redis_url: str
) -> None:
    """A pool process's first start that claims found its function uncompiled and planned it
    for its values (4 ms, then 0.5-0.9 ms for each of the next five, against 0.2): a new
    main-pool session calls it once on no row, which leaves a due row as it was and asks for
    no claim; a session on a schema not migrated yet is still handed out. Counted in the
    function's calls (track_functions), so no clock is involved."""
    from psycopg.conninfo import make_conninfo

    from outbox_dispatch.store import Store

    cmd = commands(family="quick")
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    schema = dispatcher.schema
    counted = make_conninfo(database_url, options="-c track_functions=pl")
    store = Store(counted, schema, pool_size=1)
    try:
        with psycopg.connect(database_url, autocommit=True) as listening:
            listening.execute(f'LISTEN "{store.channel}"')
            with store.connection() as conn:  # the pool's one session: warmed as it opened
                conn.execute("SELECT pg_stat_force_next_flush()")  # this session's, at its end
                row = conn.execute(
                    "SELECT calls FROM pg_stat_user_functions"
                    " WHERE schemaname = %s AND funcname = 'outbox_claim_start'",
                    (schema,),
                ).fetchone()
            assert row == (1,), row  # its call: only this session counts calls (track_functions)
            assert list(listening.notifies(timeout=0.2)) == []  # asked for no claim
        with psycopg.connect(database_url) as conn:
            kept = conn.execute(
                f'SELECT attempts, claim_token FROM "{schema}".outbox WHERE id = %s', (row_id,)
            ).fetchone()
        assert kept == (0, None)
    finally:
        store.close()

    with dispatcher_under("", database_url, redis_url, "bare") as (unmigrated, _url):
        with unmigrated.database().store.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
