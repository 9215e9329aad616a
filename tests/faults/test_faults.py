"""Postgres and Redis going down, through a proxy we cut (the shared servers stay up): enqueue
fails the caller's transaction and writes nothing; deliveries cut off mid-run are redone after
the outage, nothing lost; capped claims pause with a warning and resume."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import (
    Backoff,
    Context,
    DatabaseError,
    DatabaseUnavailable,
    Dispatcher,
    Message,
    OutboxError,
    Outcome,
)
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.store import deliveries, health
from tests.conftest import count_rows
from tests.support.faultproxy import FaultProxy

pytestmark = pytest.mark.usefixtures("clean")

REDIS_DB = 9  # this module's Redis db: only keys under its own prefix are touched


def _port(url: str) -> int:
    return urlsplit(url).port or 5432


@pytest.fixture
def pg_proxy(database_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(_port(database_url)) as proxy:
        yield proxy


@pytest.fixture
def redis_proxy(redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(urlsplit(redis_url).port or 6379) as proxy:
        yield proxy


@pytest.fixture
def make_dispatcher(schema: str) -> Iterator[Callable[..., Dispatcher]]:
    """Dispatchers on the session schema whose URLs the test chooses (a proxy's, usually)."""
    made: list[Dispatcher] = []

    def make(database_url: str, redis_url: str | None = None, **kw: Any) -> Dispatcher:
        app = Celery(f"faults_{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
        d = Dispatcher(
            app,
            database_url=database_url,
            redis_url=redis_url,
            schema=schema,
            listen=False,
            **kw,
        )
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture(scope="module")
def orders(database_url: str, schema: str) -> Iterator[str]:
    """A business table, written in the same transaction as the outbox row."""
    table = f'"{schema}".fault_orders'
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (ref text PRIMARY KEY)")
    yield table
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def _count(database_url: str, sql: str, *params: Any) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


# -- Postgres down at enqueue -------------------------------------------------------------------

ENQUEUE_WAYS = ["enqueue", "enqueue_many", "ordered", "cut_before_commit"]


@pytest.mark.parametrize("way", ENQUEUE_WAYS)
def test_postgres_down_at_enqueue_fails_the_transaction_and_writes_nothing(
    way: str,
    pg_proxy: FaultProxy,
    make_dispatcher: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
    orders: str,
) -> None:
    d = make_dispatcher(database_url)  # the producer: enqueue only uses the caller's connection
    d.family("fault_line", ordered=True)
    d.declare("fault.plain", family="intent")
    d.declare("fault.line", family="fault_line")
    ref = f"{way}-{uuid.uuid4().hex[:6]}"

    def write(conn: psycopg.Connection[Any], cut: bool) -> None:
        with conn.transaction():
            conn.execute(f"INSERT INTO {orders} (ref) VALUES (%s)", (ref,))
            if cut and way != "cut_before_commit":
                pg_proxy.cut()
            if way == "enqueue_many":
                d.enqueue_many(conn, [Message("fault.plain", {"ref": ref}) for _ in range(3)])
            elif way == "ordered":
                d.enqueue(conn, "fault.line", {"ref": ref}, actor=ref)
            else:
                d.enqueue(conn, "fault.plain", {"ref": ref}, dedupe_key=ref)
            if cut and way == "cut_before_commit":
                pg_proxy.cut()  # the enqueue went through; the commit cannot

    with psycopg.connect(pg_proxy.url(database_url)) as conn:
        with pytest.raises(psycopg.Error if way == "cut_before_commit" else DatabaseError) as info:
            write(conn, cut=True)
        assert conn.broken
    message = str(info.value)
    if way != "cut_before_commit":  # our error: says which call failed and why
        assert message.startswith(
            f"{'enqueue_many' if way == 'enqueue_many' else 'enqueue'} failed"
        )
    assert "server closed the connection" in message
    pg_proxy.restore()
    # nothing half written: neither the business row nor any outbox row
    assert _count(database_url, f"SELECT count(*) FROM {orders} WHERE ref = %s", ref) == 0
    assert count_rows(database_url, schema) == 0

    # the same transaction through the restored proxy writes both (the check above is not vacuous)
    with psycopg.connect(pg_proxy.url(database_url)) as conn:
        write(conn, cut=False)
    assert _count(database_url, f"SELECT count(*) FROM {orders} WHERE ref = %s", ref) == 1
    assert count_rows(database_url, schema) == (3 if way == "enqueue_many" else 1)


# -- Postgres down during delivery --------------------------------------------------------------


def test_postgres_down_during_delivery_loses_nothing(
    pg_proxy: FaultProxy,
    make_dispatcher: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
) -> None:
    """The worker's Postgres goes away for about a second while a handler runs: its settle
    waits for the database's return and settles the row, and the messages that follow start
    once it is back. Every row runs once, attempt 1, unflagged."""
    d = make_dispatcher(pg_proxy.url(database_url), pool_size=2)
    d.family("pgdown", lease=10.0, heartbeat_timeout=2.0, max_attempts=3)
    runs: list[tuple[int, int, bool]] = []

    def handler(ctx: Context, payload: Any) -> None:
        runs.append((ctx.row_id, ctx.attempt, ctx.maybe_applied))
        if payload.get("cut") and ctx.attempt == 1:
            pg_proxy.cut()  # Postgres goes down while this handler runs, before its settle
            restore.start()  # for about a second

    restore = threading.Timer(1.0, pg_proxy.restore)
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    d.handler(cmd, family="pgdown")(handler)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = d.enqueue_many(conn, [Message(cmd, {"cut": True})] + [Message(cmd, {})] * 5)
    claimed = d.claimer.claim_family(d.families["pgdown"]).claimed
    assert [c.id for c in claimed] == ids
    try:
        outcomes = [
            d.delivery.deliver(c.id, c.token, family_hint="pgdown").outcome for c in claimed
        ]
    finally:
        restore.join()
        pg_proxy.restore()
    assert outcomes == [Outcome.DELIVERED] * len(ids)
    assert count_rows(database_url, schema) == 0
    assert sorted(runs) == [(row_id, 1, False) for row_id in ids]


def test_postgres_down_longer_than_the_pools_wait_leaves_a_row_to_run_again_flagged(
    monkeypatch: pytest.MonkeyPatch,
    pg_proxy: FaultProxy,
    make_dispatcher: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
) -> None:
    """An outage longer than the pool's wait for a connection: that settle fails, the messages
    that follow cannot start. After the outage every row is delivered: the cut-off attempt is
    redone with maybe_applied set, rows that never started cost no attempt."""
    d = make_dispatcher(pg_proxy.url(database_url), pool_size=2)
    # the pool's wait (30 s by default) and a start's patience (60 s), for a short test
    d.store.pool.get().timeout = 1.0
    monkeypatch.setattr(health, "PATIENCE", 1.0)
    d.family(
        "pgdown", lease=1.0, heartbeat_timeout=2.0, max_attempts=3, backoff=Backoff(0.05, 0.1, 0.0)
    )
    runs: list[tuple[int, int, bool]] = []

    def handler(ctx: Context, payload: Any) -> None:
        runs.append((ctx.row_id, ctx.attempt, ctx.maybe_applied))
        if payload.get("cut") and ctx.attempt == 1:
            pg_proxy.cut()

    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    d.handler(cmd, family="pgdown")(handler)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = d.enqueue_many(conn, [Message(cmd, {"cut": True})] + [Message(cmd, {})] * 2)
    claimed = d.claimer.claim_family(d.families["pgdown"]).claimed
    assert [c.id for c in claimed] == ids
    errors: list[OutboxError] = []
    outcomes: list[Outcome] = []
    try:
        for c in claimed:  # a worker taking the messages one after another
            try:
                outcomes.append(d.delivery.deliver(c.id, c.token, family_hint="pgdown").outcome)
            except OutboxError as exc:  # Celery logs the task's failure and acks the message
                errors.append(exc)
    finally:
        pg_proxy.restore()
    assert isinstance(errors[0], DatabaseUnavailable)
    assert str(errors[0]).startswith("settle (delete): no database connection in time")
    assert Outcome.DELIVERED not in outcomes  # nothing settled while Postgres was away

    deadline = time.monotonic() + 20
    while count_rows(database_url, schema, "family = 'pgdown' AND parked_at IS NULL") > 0:
        assert time.monotonic() < deadline, f"rows left after the outage: {runs}"
        with contextlib.suppress(DatabaseError):
            d.drain(timeout=5)
        time.sleep(0.1)
    assert count_rows(database_url, schema) == 0  # delivered, none parked

    first, rest = ids[0], ids[1:]
    assert [r for r in runs if r[0] == first] == [(first, 1, False), (first, 2, True)]
    for row_id in rest:  # their first messages never started: one run, still attempt 1
        assert [r for r in runs if r[0] == row_id] == [(row_id, 1, False)]


def test_postgres_down_at_claim_fails_the_pass_clearly_and_claims_nothing(
    pg_proxy: FaultProxy,
    make_dispatcher: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
) -> None:
    d = make_dispatcher(pg_proxy.url(database_url), pool_size=1)
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    seen: list[int] = []
    d.handler(cmd, family="intent")(lambda ctx, payload: seen.append(ctx.row_id))
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = d.enqueue(conn, cmd, {})
    assert d.drain(timeout=5).delivered == 1  # the pool holds a connection through the proxy
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = d.enqueue(conn, cmd, {})
    pg_proxy.cut()
    d.store.pool.get().timeout = 1.0  # the pool's wait (30 s by default), for a short test
    published: list[Claimed] = []
    failed = r"^claim (of family \w+|pass \(which families have due rows\)): "
    with pytest.raises(DatabaseUnavailable, match=failed + "no database connection in time"):
        d.claimer.run(lambda fam, rows, size: published.extend(rows))
    assert published == []
    pg_proxy.restore()
    d.store.pool.get().timeout = 30.0  # it waits for the pool to reconnect
    assert count_rows(database_url, schema, "claim_token IS NULL AND attempts = 0") == 1
    assert d.drain(timeout=5).delivered == 1
    assert seen[-1] == row_id


# -- Redis down ---------------------------------------------------------------------------------


@pytest.fixture
def caps_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"odfault{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def caps_via_proxy(
    redis_proxy: FaultProxy,
    make_dispatcher: Callable[..., Dispatcher],
    caps_prefix: str,
    database_url: str,
    redis_url: str,
) -> Dispatcher:
    """A dispatcher whose caps reach Redis through the proxy a test can cut."""
    caps_url = redis_proxy.url(redis_url).rsplit("/", 1)[0] + f"/{REDIS_DB}"
    return make_dispatcher(database_url, caps_url, key_prefix=caps_prefix)


def _warnings(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.__dict__.get("action") == action]


def test_redis_down_pauses_capped_claims_with_a_clear_warning_and_they_resume(
    redis_proxy: FaultProxy,
    caps_via_proxy: Dispatcher,
    database_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = caps_via_proxy
    d.family("capdown", per_actor=1, lease=5, max_attempts=3)
    ran: list[tuple[int, str | None]] = []
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    d.handler(cmd, family="capdown")(lambda ctx, payload: ran.append((ctx.row_id, ctx.actor)))
    with psycopg.connect(database_url) as conn, conn.transaction():
        a1, a2, free = d.enqueue_many(
            conn, [Message(cmd, {}, actor="A"), Message(cmd, {}, actor="A"), Message(cmd, {})]
        )

    def claim_pass() -> tuple[list[Claimed], float]:
        out: list[Claimed] = []
        t0 = time.monotonic()
        d.claimer.run(lambda fam, rows, size: out.extend(rows), only=["capdown"])
        return out, time.monotonic() - t0

    redis_proxy.cut()
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        for n in (1, 2):
            out, took = claim_pass()
            assert [c.id for c in out] == ([free] if n == 1 else [])  # uncapped rows still go
            for c in out:
                assert d.delivery.deliver(c.id, c.token).outcome is Outcome.DELIVERED
            assert took < 2.0, f"a claim pass took {took:.1f} s while Redis was down"
            warned = _warnings(caplog, "caps_unavailable")
            assert len(warned) == n  # one warning per claim pass
    line = warned[-1].getMessage()
    # actionable: which Redis, what it answered, what happens to the rows, which family
    assert f"Redis at redis://127.0.0.1:{redis_proxy.port}/{REDIS_DB}" in line
    assert "ConnectionError" in line
    assert "capped rows wait in Postgres until it is back" in line
    assert "family='capdown'" in line
    # the capped rows stay due in Postgres, untouched: no attempt, no token, not waiting
    assert (
        count_rows(
            database_url,
            schema,
            f"id IN ({a1}, {a2}) AND claim_token IS NULL AND attempts = 0 AND NOT waiting",
        )
        == 2
    )

    redis_proxy.restore()
    done: list[int] = [free]
    deadline = time.monotonic() + 15
    while len(done) < 3:  # what the beat would do: a pass, the workers deliver what it sent
        assert time.monotonic() < deadline, f"capped rows did not resume: {done}"
        out, _ = claim_pass()
        assert len({c.actor for c in out if c.actor}) == len([c for c in out if c.actor])
        for c in out:
            assert d.delivery.deliver(c.id, c.token, family_hint="capdown").outcome is (
                Outcome.DELIVERED
            )
            done.append(c.id)
        time.sleep(0.05)
    assert sorted(done) == sorted([a1, a2, free])
    assert [r for r, actor in ran if actor == "A"] == [a1, a2]  # in order, one at a time
    assert count_rows(database_url, schema) == 0


def test_redis_down_at_delivery_hands_a_capped_row_back_uncounted(
    redis_proxy: FaultProxy,
    caps_via_proxy: Dispatcher,
    database_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = caps_via_proxy
    # the handed-back row's slot cannot be released while Redis is away: it expires with the
    # lease, so a short lease keeps this test short
    d.family("capdeliver", per_actor=1, lease=1.5, max_attempts=3)
    ran: list[int] = []
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    d.handler(cmd, family="capdeliver")(lambda ctx, payload: ran.append(ctx.attempt))
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = d.enqueue(conn, cmd, {}, actor="B")
    [claimed] = d.claimer.claim_family(d.families["capdeliver"]).claimed
    redis_proxy.cut()  # between the claim and the delivery: the slot cannot be checked
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        result = d.delivery.deliver(claimed.id, claimed.token, family_hint="capdeliver")
    assert result.outcome is Outcome.STALE
    assert ran == []
    [line] = [r.getMessage() for r in _warnings(caplog, "caps_unavailable")]
    assert "row handed back" in line and f"row_id={row_id}" in line
    assert count_rows(database_url, schema, "claim_token IS NULL AND attempts = 0") == 1

    redis_proxy.restore()
    deadline = time.monotonic() + 10
    while not ran:
        assert time.monotonic() < deadline, "the handed-back row was not delivered"
        d.drain(timeout=5)
        time.sleep(0.05)
    assert ran == [1]  # the handed-back claim cost no attempt
    assert count_rows(database_url, schema) == 0


def test_redis_down_warning_names_the_cause(
    redis_proxy: FaultProxy,
    caps_via_proxy: Dispatcher,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = caps_via_proxy
    d.family("capcause", per_actor=1, lease=5)
    d.declare("fault.cause", family="capcause")
    with psycopg.connect(database_url) as conn, conn.transaction():
        d.enqueue(conn, "fault.cause", {}, actor="C")
    redis_proxy.cut()
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        d.claimer.run(lambda fam, rows, size: None, only=["capcause"])
    [line] = [r.getMessage() for r in _warnings(caplog, "caps_unavailable")]
    assert "Connection refused" in line


def test_a_holder_cut_off_from_redis_stops_before_its_slot_can_go_to_another_row(
    redis_proxy: FaultProxy,
    caps_via_proxy: Dispatcher,
    make_dispatcher: Callable[..., Dispatcher],
    caps_prefix: str,
    database_url: str,
    redis_url: str,
    schema: str,
) -> None:
    """A network partition between one worker and Redis: the claimer still reaches Redis and
    grants the actor's slot again once it expires there. The worker cannot renew it, so its
    handler is told to stop before that, and the row is retried, not settled as delivered."""
    worker = caps_via_proxy
    claimer = make_dispatcher(
        database_url, redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}", key_prefix=caps_prefix
    )
    marks: dict[str, float] = {}
    started = threading.Event()

    def handler(ctx: Context, payload: Any) -> None:
        if ctx.attempt > 1 or payload.get("second"):
            return
        marks["started"] = time.monotonic()
        started.set()
        deadline = time.monotonic() + 15
        while not ctx.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        marks["stopped"] = time.monotonic()

    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    for d in (worker, claimer):
        d.family("partition", per_actor=1, lease=10, heartbeat_timeout=3, max_attempts=3)
        d.handler(cmd, family="partition")(handler)
    with psycopg.connect(database_url) as conn, conn.transaction():
        first, second = d.enqueue_many(
            conn, [Message(cmd, {}, actor="P"), Message(cmd, {"second": True}, actor="P")]
        )
    [c1] = claimer.claimer.claim_family(claimer.families["partition"]).claimed
    assert c1.id == first
    outcome: list[Outcome] = []
    t = threading.Thread(
        target=lambda: outcome.append(
            worker.delivery.deliver(c1.id, c1.token, family_hint="partition").outcome
        )
    )
    t.start()
    assert started.wait(5)
    redis_proxy.cut()
    granted: list[Claimed] = []
    deadline = time.monotonic() + 15
    while not granted:  # the claimer, which reaches Redis, polls like beat would
        assert time.monotonic() < deadline, "the slot never came free"
        # the actor's slot goes to either row: the second, or the first's retry, due 0.9 s
        # after its stop, while the second, set waiting by an earlier poll, is out of the due
        # range until a release (which the cut-off worker could not send) or a lease
        granted = [
            c
            for c in claimer.claimer.claim_family(claimer.families["partition"]).claimed
            if c.id in (first, second)
        ]
        if not granted:
            time.sleep(0.05)
    granted_at = time.monotonic()
    t.join(15)
    assert "stopped" in marks and marks["stopped"] <= granted_at, (
        f"the cut-off holder ran {granted_at - marks.get('stopped', granted_at):.2f} s past "
        "the slot's grant to another row"
    )
    assert outcome == [Outcome.RETRIED]
    assert count_rows(database_url, schema, f"id = {first} AND maybe_applied") == 1


# -- no connection for a transactional handler --------------------------------------------------


def test_a_transactional_delivery_needs_one_session_the_one_its_start_used(
    make_dispatcher: Callable[..., Dispatcher], database_url: str, schema: str
) -> None:
    """A worker process that may hold one Postgres session (its pool's size, or its share of
    the server's connections) claims, starts and runs transactional rows: the handler's
    transaction takes the connection the start gave back."""
    d = make_dispatcher(database_url, pool_size=1, handler_pool_size=0)
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    seen: list[int] = []

    @d.handler(cmd, family="intent", transactional=True)
    def write(ctx: Context, payload: Any) -> None:
        assert ctx.conn is not None
        seen.append(ctx.conn.execute("SELECT pg_backend_pid()").fetchone()[0])

    with psycopg.connect(database_url) as conn, conn.transaction():
        for _ in range(3):
            d.enqueue(conn, cmd, {})
    assert d.drain(timeout=10).delivered == 3
    assert d.store.pool.get().get_stats()["pool_max"] == 1 and len(set(seen)) == 1
    assert count_rows(database_url, schema, "true") == 0


def test_a_transactional_row_whose_worker_has_no_connection_for_it_goes_back_uncounted(
    monkeypatch: pytest.MonkeyPatch,
    make_dispatcher: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
) -> None:
    """A worker whose pool (or share of Postgres's connections) is used up when its
    transactional handler's transaction begins (another thread took the connection its start
    gave back): the handler never runs, and its row is due again at once for another worker,
    its attempt not spent (it would otherwise wait the pool's 30 s and count as a failure)."""
    d = make_dispatcher(database_url, pool_size=1, handler_pool_size=0)  # one session
    monkeypatch.setattr(deliveries, "CONNECTION_WAIT", 0.5)
    begin = d.store.handler_transaction

    @contextlib.contextmanager
    def taken_first(row_id: int, token: uuid.UUID) -> Iterator[Any]:
        with d.store.connection(), begin(row_id, token) as held:  # the only one, taken
            yield held

    monkeypatch.setattr(d.store, "handler_transaction", taken_first)
    ran: list[int] = []
    cmd = f"fault.{uuid.uuid4().hex[:6]}"
    d.handler(cmd, family="intent", transactional=True)(lambda ctx, p: ran.append(ctx.row_id))
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = d.enqueue(conn, cmd, {})
    [claimed] = d.claimer.claim_family(d.families["intent"]).claimed
    result = d.delivery.deliver(claimed.id, claimed.token, family_hint="intent")
    assert result.outcome is Outcome.STALE and ran == []
    monkeypatch.undo()
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            f'SELECT attempts, claim_token, started_at, due_at <= now() FROM "{schema}".outbox'
            " WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert row == (0, None, None, True)
    assert d.drain(timeout=5).delivered == 1  # a worker with a connection runs it
    assert ran == [row_id]
