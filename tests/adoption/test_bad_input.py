"""Bad input that test_enqueue, delivery/test_delivery, settle/test_settle and
delivery/test_worker do not cover yet: the remaining enqueue and cancel checks, bad
identifiers, payloads a handler's own schema rejects (in every kind of handler), rows of a
family or command this worker does not know, and broker messages that are not ours (pickle,
raw bodies, unknown task names)."""

from __future__ import annotations

import logging
import math
import pickle
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
import redis
from celery import Celery

import outbox_dispatch
from outbox_dispatch import (
    Backoff,
    ConfigurationError,
    Context,
    Dispatcher,
    InvalidArgument,
    InvalidIdentifier,
    InvalidPayload,
    Message,
    Outcome,
    PermanentFailure,
    RetryLater,
)
from outbox_dispatch.celery.wiring import DELIVER_TASK
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects

pytestmark = pytest.mark.usefixtures("clean")


def _row(database_url: str, schema: str, row_id: int) -> dict[str, Any]:
    with psycopg.connect(database_url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        found = cur.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert found is not None
    return found


def _enqueue(d: Dispatcher, database_url: str, cmd: str, payload: Any = None, **kw: Any) -> int:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return d.enqueue(conn, cmd, payload if payload is not None else {}, **kw)


@pytest.fixture
def other_app() -> Iterator[Callable[..., Dispatcher]]:
    """Another service's dispatcher on the same schema (its own families and handlers)."""
    made: list[Dispatcher] = []

    def make(database_url: str, schema: str) -> Dispatcher:
        app = Celery(f"other_{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
        d = Dispatcher(app, database_url=database_url, schema=schema, listen=False)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


# -- enqueue and cancel checks ------------------------------------------------------------------


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# enqueue inputs beyond test_enqueue.BAD_INPUTS; test_enqueue runs both lists
MORE_BAD_INPUTS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("actor too long", {"actor": "a" * 513}, InvalidArgument),
    ("actor with NUL", {"actor": "a\x00b"}, InvalidArgument),
    ("actor lone surrogate", {"actor": "\udfff"}, InvalidArgument),
    ("dedupe key empty", {"dedupe_key": ""}, InvalidArgument),
    ("dedupe key with NUL", {"dedupe_key": "k\x00"}, InvalidArgument),
    ("at not a datetime", {"at": "2030-01-01T00:00:00Z"}, InvalidArgument),
    ("at as a timestamp", {"at": time.time()}, InvalidArgument),
    ("delay as a float", {"delay": 1.5}, InvalidArgument),
    ("payload lone surrogate", {"payload": {"name": "\ud800"}}, InvalidPayload),
    ("payload bytes", {"payload": {"blob": b"\x00\x01"}}, InvalidPayload),
    ("payload tuple key", {"payload": {(1, 2): "a"}}, InvalidPayload),
    ("payload infinity", {"payload": [float("inf")]}, InvalidPayload),
    ("payload deep NUL key", {"payload": {"a": [{"b\x00": 1}]}}, InvalidPayload),
    ("payload nested too deeply", {"payload": _nested(10_000)}, InvalidPayload),  # RecursionError
    ("at in year 9999", {"at": datetime(9999, 12, 31, 23, tzinfo=UTC)}, InvalidArgument),
]


def test_enqueue_many_refuses_what_is_not_a_message(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(InvalidArgument, match="takes Message objects, got dict"):
            dispatcher.enqueue_many(conn, [Message(cmd, {}), {"command": cmd}])  # type: ignore[list-item]
        conn.execute("SELECT 1")
    assert count_rows(database_url, dispatcher.schema) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs a row id, a dedupe_key, or an actor"),
        ({"row_id": "7"}, "row_id must be an int"),
        ({"row_id": True}, "row_id must be an int"),
        ({"row_id": 2**63}, "out of range"),  # it reached Postgres as a DatabaseError
        # selectors narrowed each other, and a pending row matched nothing
        ({"row_id": 1, "dedupe_key": "k"}, "one of a row id, a dedupe_key or an actor"),
        ({"dedupe_key": "k", "actor": "a"}, "one of a row id, a dedupe_key or an actor"),
        ({"row_id": 1, "command": "c"}, "command narrows an actor's rows"),
        ({"dedupe_key": 7}, "dedupe_key must be a str"),
        ({"actor": b"a"}, "actor must be a str"),
        ({"actor": "a", "command": 3}, "command must be a str"),
        ({"row_id": 1, "reason": ["x"]}, "reason must be a str"),
        ({"row_id": 1, "by": object()}, "by must be a str"),
    ],
)
def test_bad_cancel_arguments_are_refused_before_any_sql(
    dispatcher: Dispatcher, database_url: str, kwargs: dict[str, Any], match: str
) -> None:
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(InvalidArgument, match=match):
            dispatcher.cancel(conn, **kwargs)
        conn.execute("SELECT 1")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schema": 'outbox"; DROP TABLE x; --'},
        {"schema": "public.outbox"},
        {"queue_prefix": "outbox.evil"},
        {"queue_prefix": "a b"},
        {"key_prefix": "out{box}"},
        {"key_prefix": "out box"},
        {"key_prefix": "out\nbox"},
    ],
)
def test_identifiers_that_reach_sql_queue_names_or_redis_keys_are_validated(
    kwargs: dict[str, Any],
) -> None:
    app = Celery("idents", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError):  # InvalidIdentifier is a ConfigurationError
        Dispatcher(
            app,
            database_url="postgresql://nobody@127.0.0.1:1/none",
            redis_url="redis://127.0.0.1:1/0",
            **kwargs,
        )


def test_a_password_with_an_unescaped_at_sign_is_refused_without_showing_it() -> None:
    """libpq ends the password at its first '@' and takes the rest as the host; connecting
    then failed with 'could not translate host name "cret@127.0.0.1"', a piece of the
    password in every log line."""
    app = Celery("at_sign", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="%40") as raised:
        Dispatcher(app, database_url="postgresql://app:s3@cret@127.0.0.1:5432/shop")
    assert "cret" not in str(raised.value) and "s3" not in str(raised.value)
    Dispatcher(app, database_url="postgresql://app:s3%40cret@127.0.0.1:5432/shop")  # escaped


def test_family_and_cron_names_are_validated() -> None:
    app = Celery("idents2", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url="postgresql://nobody@127.0.0.1:1/none")
    for bad in ["UPPER", "a-b", "a.b", "1abc", "", "x" * 49, "é"]:
        with pytest.raises(InvalidIdentifier):
            d.family(bad)
    d.declare("c.cron")
    with pytest.raises(ConfigurationError, match="not a cron expression"):
        d.ops.cron("bad", "61 * * * *", "c.cron", {})
    with pytest.raises(ConfigurationError, match="unknown time zone"):
        d.ops.cron("bad", "* * * * *", "c.cron", {}, tz="Mars/Olympus")
    with pytest.raises(InvalidPayload):
        d.ops.cron("bad", "* * * * *", "c.cron", {"when": datetime.now(UTC)})


def test_family_takes_max_lost_as_documented() -> None:
    app = Celery("max_lost", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url="postgresql://nobody@127.0.0.1:1/none")
    documented: dict[str, Any] = {"max_lost": 2}
    fam = d.family("fragile", max_attempts=None, **documented)
    assert fam.max_lost == 2


# -- a payload the handler's own schema rejects -------------------------------------------------


class BadPayload(PermanentFailure):
    """A handler's own validation error: retrying the same payload cannot help."""


def _validate(payload: Any) -> None:
    """What a handler's schema check looks like: wrap the validator's error as permanent."""
    try:
        if not isinstance(payload.get("email"), str):
            raise ValueError("'email' is required and must be a string")
    except ValueError as exc:
        raise BadPayload(f"payload rejected: {exc}") from exc


def test_payload_the_handler_rejects_parks_at_once_even_in_a_family_that_retries_forever(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands(family="intent", fn=lambda ctx, payload: _validate(payload))  # retries forever
    bad = _enqueue(dispatcher, database_url, cmd, {"email": 42})
    good = _enqueue(dispatcher, database_url, cmd, {"email": "a@example.com"})
    report = dispatcher.drain(timeout=5)
    assert (report.count(Outcome.PARKED), report.delivered) == (1, 1)
    row = _row(database_url, dispatcher.schema, bad)
    assert row["parked_at"] is not None and row["attempts"] == 1
    assert row["last_error"] == (
        "tests.adoption.test_bad_input.BadPayload: "
        "payload rejected: 'email' is required and must be a string"
    )
    # not retried: later passes leave it parked and never run it again
    time.sleep(0.1)
    assert dispatcher.drain(timeout=5).rounds == 0
    assert effects.rows(cmd) == [bad, good]
    parked = dispatcher.store.parked_list()
    assert [(p["id"], p["attempts"]) for p in parked] == [(bad, 1)]


def test_payload_rejected_in_a_batch_parks_only_that_row(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands(family="bulk", fn=lambda ctx, payload: _validate(payload))  # batch=10
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(
            conn, [Message(cmd, {"email": "x@y"} if i != 3 else {}) for i in range(6)]
        )
    report = dispatcher.drain(timeout=5)
    assert (report.delivered, report.count(Outcome.PARKED)) == (5, 1)
    row = _row(database_url, dispatcher.schema, ids[3])
    assert row["attempts"] == 1 and "payload rejected" in row["last_error"]
    assert count_rows(database_url, dispatcher.schema) == 1


def test_payload_rejected_by_a_transactional_handler_parks_and_rolls_its_writes_back(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE IF NOT EXISTS "{schema}".bad_input_effects (row_id bigint)')
    cmd = f"t.txn.{uuid.uuid4().hex[:6]}"

    @dispatcher.handler(cmd, family="quick", transactional=True)
    def write_then_validate(ctx: Context, payload: Any) -> None:
        ctx.conn.execute(
            f'INSERT INTO "{schema}".bad_input_effects (row_id) VALUES (%s)', (ctx.row_id,)
        )
        _validate(payload)

    bad = _enqueue(dispatcher, database_url, cmd, {"email": None})
    good = _enqueue(dispatcher, database_url, cmd, {"email": "ok@example.com"})
    report = dispatcher.drain(timeout=5)
    assert (report.delivered, report.count(Outcome.PARKED)) == (1, 1)
    row = _row(database_url, schema, bad)
    assert row["attempts"] == 1 and "payload rejected" in row["last_error"]
    with psycopg.connect(database_url) as conn:
        written = conn.execute(f'SELECT row_id FROM "{schema}".bad_input_effects').fetchall()
    assert written == [(good,)]


def test_an_ordinary_exception_from_a_schema_check_is_retried_not_parked(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """Only PermanentFailure parks at once: a bare ValueError is a failure like any other."""

    def strict(ctx: Context, payload: Any) -> None:
        raise ValueError("'email' is required")

    cmd = commands(family="quick", fn=strict)  # max_attempts=3
    row_id = _enqueue(dispatcher, database_url, cmd, {})
    assert dispatcher.drain(timeout=5).count(Outcome.RETRIED) == 1
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["parked_at"] is None and row["attempts"] == 1


# -- rows of a family or command this worker does not know --------------------------------------


def test_row_of_a_family_this_worker_does_not_declare_is_parked_with_a_clear_error(
    dispatcher: Dispatcher,
    other_app: Callable[..., Dispatcher],
    database_url: str,
    schema: str,
) -> None:
    producer = other_app(database_url, schema)  # it claims, and publishes to outbox.elsewhere
    producer.family("elsewhere", lease=30)
    producer.declare("x.elsewhere", family="elsewhere")
    row_id = _enqueue(producer, database_url, "x.elsewhere", {"n": 1})
    [claimed] = producer.claimer.claim_family(producer.families["elsewhere"]).claimed

    # a worker that consumes that queue without declaring the family (a stale deploy)
    [result] = dispatcher.delivery.deliver_message(
        (claimed.id, str(claimed.token)), family_hint="elsewhere"
    )
    assert result.outcome is Outcome.PARKED
    row = _row(database_url, schema, row_id)
    assert row["attempts"] == 1
    assert row["last_error"] == (
        "family 'elsewhere' is not declared in this worker: "
        "declare it with dispatcher.family() and retry the parked row"
    )

    # once a worker knows it, `parked retry` brings it back and it is delivered
    fixed = other_app(database_url, schema)
    fixed.family("elsewhere", lease=30)
    seen: list[int] = []
    fixed.handler("x.elsewhere", family="elsewhere")(lambda ctx, p: seen.append(ctx.attempt))
    assert fixed.ops.parked_retry(ids=[row_id]) == [row_id]
    assert fixed.drain(timeout=5).delivered == 1
    assert seen == [1]


def test_row_of_a_command_this_worker_has_never_heard_of_is_parked(
    dispatcher: Dispatcher, other_app: Callable[..., Dispatcher], database_url: str, schema: str
) -> None:
    producer = other_app(database_url, schema)
    cmd = f"x.unknown.{uuid.uuid4().hex[:6]}"
    producer.declare(cmd, family="intent")
    row_id = _enqueue(producer, database_url, cmd)
    [claimed] = producer.claimer.claim_family(producer.families["intent"]).claimed
    [result] = dispatcher.delivery.deliver_message((claimed.id, str(claimed.token)))
    assert result.outcome is Outcome.PARKED
    row = _row(database_url, schema, row_id)
    assert row["attempts"] == 1
    assert f"no handler for command {cmd!r} in this worker" in row["last_error"]


def test_message_routed_through_an_unknown_family_queue_still_delivers_its_row(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    """The routing key only chooses the lease of the begin statement; the row decides the
    rest, so a message from an unknown queue is neither trusted nor lost."""
    cmd = commands()
    row_id = _enqueue(dispatcher, database_url, cmd)
    [claimed] = dispatcher.claimer.claim_family(dispatcher.families["intent"]).claimed
    [result] = dispatcher.delivery.deliver_message(
        (claimed.id, str(claimed.token)), family_hint="no_such_family"
    )
    assert result.outcome is Outcome.DELIVERED
    assert effects.rows(cmd) == [row_id]


# -- broker messages that are not ours ----------------------------------------------------------

UNPICKLED: list[str] = []


def _mark_unpickled(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Trap:
    """Unpickling this object calls _mark_unpickled: a worker that unpickles leaves a mark."""

    def __reduce__(self) -> tuple[Callable[[str], str], tuple[str]]:
        return _mark_unpickled, ("unpickled!",)


@pytest.fixture
def queue_keys(key_prefix: str, redis_url: str) -> Iterator[Callable[[str], int]]:
    client = redis.Redis.from_url(redis_url)

    def length(queue: str) -> int:
        return int(client.llen(f"{key_prefix}{queue}"))

    yield length
    client.close()


def test_foreign_broker_messages_are_refused_and_the_worker_keeps_delivering(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    worker: object,
    queue_keys: Callable[[str], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    cmd = commands()
    row_id = _enqueue(dispatcher, database_url, cmd, {"n": 1})
    task = dispatcher.app.tasks[DELIVER_TASK]
    app = dispatcher.app
    assert pickle.loads(pickle.dumps(Trap())) == "unpickled!"  # noqa: S301 (the trap works)
    UNPICKLED.clear()
    with caplog.at_level(logging.WARNING):
        # a delivery task serialized with pickle: the worker must refuse to decode it
        task.apply_async((Trap(), str(uuid.uuid4())), queue="outbox.intent", serializer="pickle")
        # a raw body that is not a Celery task at all
        with app.producer_or_acquire() as producer:
            producer.publish(
                {"drop": "table"}, exchange="", routing_key="outbox.intent", serializer="json"
            )
        # a task name no one registered
        app.send_task("outbox.nope", args=[row_id, str(uuid.uuid4())], queue="outbox.intent")
        # and the real claim, published last
        assert dispatcher.runtime.claim_and_publish().claimed == {"intent": 1}
        deadline = time.monotonic() + 15
        while count_rows(database_url, dispatcher.schema) or queue_keys("outbox.intent"):
            assert time.monotonic() < deadline, "the worker stopped delivering"
            time.sleep(0.05)
        time.sleep(0.2)
    assert UNPICKLED == []
    assert effects.rows(cmd) == [row_id]
    text = caplog.text
    assert "Refusing to deserialize untrusted content of type pickle" in text
    assert "outbox.nope" in text


def test_json_is_the_only_content_any_side_of_the_app_accepts(dispatcher: Dispatcher) -> None:
    """No pickle anywhere: tasks, results and events are JSON, and the package never imports
    pickle (or its wrappers) itself."""
    conf = dispatcher.app.conf
    assert conf.accept_content == ["json"]
    assert conf.result_accept_content == ["json"]
    assert (conf.task_serializer, conf.result_serializer, conf.event_serializer) == (
        "json",
        "json",
        "json",
    )
    package = Path(outbox_dispatch.__file__).parent
    for source in package.rglob("*.py"):
        code = source.read_text("utf-8")
        for module in ("pickle", "cPickle", "dill", "shelve", "marshal"):
            assert f"import {module}" not in code, f"{source} imports {module}"


# -- options at the edge of their type ----------------------------------------------------------

_NOWHERE = "postgresql://nobody@127.0.0.1:1/none"


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 2**31},  # int4 in SQL: every claim of the family failed in Postgres
        {"max_in_flight": 2**31},
        {"max_lost": 2**31},
        {"max_attempts": 2.7},
        {"max_in_flight": True},
        {"per_actor": True},  # the claim then blamed Redis for the bool, forever
        {"ordered": "false"},  # a non-empty string is truthy: an ordered family
        {"parked_blocks": "no"},
        {"backoff": "exp"},  # it failed at the first retry, after the handler had run
        {"backoff": (1, 2, 0)},
        {"lease": "90"},
    ],
    ids=repr,
)
def test_family_options_at_the_edge_of_their_type_are_refused_when_declared(
    options: dict[str, Any],
) -> None:
    app = Celery("edges", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url=_NOWHERE, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError) as raised:
        d.family("edgy", **options)
    assert next(iter(options)) in str(raised.value)


@pytest.mark.parametrize(
    "backoff", [{"base": True}, {"jitter": True}, {"base": "1"}, {"jitter": math.nan}], ids=repr
)
def test_backoff_takes_numbers_only(backoff: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="backoff"):
        Backoff(**backoff)


@pytest.mark.parametrize(
    "options",
    [
        {"claim_interval": math.nan},  # NaN <= 0 is False: it passed, and beat failed on it
        {"claim_interval": math.inf},
        {"prune_interval": 0},
        {"prune_interval": math.nan},
        {"prune_batch": -1},  # every prune pass failed: retention was never enforced
        {"prune_batch": math.nan},
        {"claim_batch": 2.5},
        {"claim_batch": 2**63},
        {"payload_limit": math.nan},  # the limit was off
        {"pool_size": "1"},
        {"listen": 1},
    ],
    ids=repr,
)
def test_dispatcher_options_at_the_edge_of_their_type_are_refused(
    options: dict[str, Any],
) -> None:
    app = Celery("edges2", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError) as raised:
        Dispatcher(app, database_url=_NOWHERE, **options)
    assert next(iter(options)) in str(raised.value)


def test_intervals_and_seconds_take_any_real_number_or_a_timedelta() -> None:
    """What the checks above refuse is only what cannot work: a Decimal, a timedelta or a
    numpy-like float is seconds, and arrives as a float."""
    app = Celery("edges3", broker="memory://", set_as_current=False)
    d = Dispatcher(
        app,
        database_url=_NOWHERE,
        claim_interval=timedelta(milliseconds=500),
        prune_interval=cast(Any, Decimal("30")),
    )
    assert (d.settings.claim_seconds, type(d.settings.claim_seconds)) == (0.5, float)
    lease: Any = Decimal("90.5")
    fam = d.family("roomy", lease=lease, heartbeat_timeout=timedelta(seconds=20))
    assert (fam.lease, fam.heartbeat_timeout) == (90.5, 20.0)
    assert type(fam.lease) is float


def test_the_largest_counts_a_family_takes_work_in_postgres(
    dispatcher: Dispatcher, database_url: str
) -> None:
    """The bounds above are the SQL's: at them, a family's rows are claimed and delivered."""
    dispatcher.family("widest", max_attempts=2**31 - 1, max_in_flight=2**31 - 1, max_lost=2**31 - 1)
    cmd = f"t.wide.{uuid.uuid4().hex[:6]}"
    dispatcher.handler(cmd, family="widest")(lambda ctx, payload: None)
    row = _enqueue(dispatcher, database_url, cmd)
    assert dispatcher.drain(timeout=5).delivered == 1
    assert count_rows(database_url, dispatcher.schema, f"id = {row}") == 0


def test_handlers_that_cannot_run_are_refused_when_registered(dispatcher: Dispatcher) -> None:
    async def later(ctx: Context, payload: Any) -> None:  # its rows once settled unrun
        raise AssertionError("never awaited")

    with pytest.raises(ConfigurationError, match="async"):
        dispatcher.handler("t.async", family="quick")(later)
    with pytest.raises(ConfigurationError, match="function"):
        dispatcher.handler("t.none", family="quick")(None)  # type: ignore[arg-type]
    # command names Postgres cannot store: every enqueue of them failed
    for bad in ["t.nul\x00", "t.\udfff"]:
        with pytest.raises(InvalidIdentifier):
            dispatcher.handler(bad, family="quick")(lambda ctx, payload: None)
        with pytest.raises(InvalidIdentifier):
            dispatcher.declare(bad, family="quick")
    assert dispatcher.registry.registration("t.async") is None


def test_a_handler_that_returns_a_coroutine_is_parked_not_delivered(
    dispatcher: Dispatcher, database_url: str
) -> None:
    """A plain function wrapping an async one (a decorator, functools.partial) gets past the
    registration check: its row must not be settled as delivered, since its work never ran."""
    ran: list[int] = []

    async def work(row_id: int) -> None:
        ran.append(row_id)

    cmd = f"t.coro.{uuid.uuid4().hex[:6]}"
    dispatcher.handler(cmd, family="quick")(lambda ctx, payload: work(ctx.row_id))
    row = _enqueue(dispatcher, database_url, cmd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be a warning
        report = dispatcher.drain(timeout=5)
    assert report.count(Outcome.PARKED) == 1
    found = _row(database_url, dispatcher.schema, row)
    assert "nothing awaits" in found["last_error"] and found["attempts"] == 1
    assert ran == []


@pytest.mark.parametrize(
    ("delay", "retried_in"),
    [
        (timedelta(seconds=30), 30.0),
        (Decimal("2.5"), 2.5),
        (2 * 365 * 86400, 2 * 365 * 86400.0),  # two years: fine, as for enqueue's delay
        ("5", None),
        (math.inf, None),
        (None, None),
        (1e12, None),  # past enqueue's bound too: the row could not have been read back
    ],
    ids=repr,
)
def test_retry_later_takes_seconds_or_a_timedelta_and_says_so_otherwise(
    delay: Any,
    retried_in: float | None,
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
) -> None:
    """A bad RetryLater delay fails in the handler, as any error does: retried with the
    family's backoff, its last_error saying why. It used to fail at the settle, after the
    handler ran, and the attempt was lost (run again with maybe_applied, then parked)."""

    def asks(ctx: Context, payload: Any) -> None:
        raise RetryLater(delay, "not yet")

    cmd = commands(family="quick", fn=asks)
    row = _enqueue(dispatcher, database_url, cmd)
    [claimed] = dispatcher.claimer.claim_family(dispatcher.families["quick"]).claimed
    result = dispatcher.delivery.deliver(claimed.id, claimed.token, family_hint="quick")
    assert result.outcome is Outcome.RETRIED
    found = _row(database_url, dispatcher.schema, row)
    assert not found["maybe_applied"]
    if retried_in is not None:
        assert result.due_in == retried_in and found["last_error"] == "not yet"
    else:
        assert "RetryLater delay must be seconds" in found["last_error"]


def test_a_row_whose_delivery_fails_outside_its_handler_does_not_hold_up_its_batch(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """In a batched message, one row whose settle raises something unforeseen (a bug, a value
    nobody checked) is that row's problem: the rows after it run now. They used to stay
    claimed, unrun, until their lease (10 s here, 60 s by default). A database error still
    ends the message: each row after it would wait for the same pool."""
    seen: list[int] = []
    cmd = commands(family="bulk", fn=lambda ctx, payload: seen.append(ctx.row_id))  # batch=10
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(5)])
    delivery = dispatcher.delivery
    settle = delivery.settler.settle

    def refuses_one(kind: Any, started: Any, *args: Any, **kwargs: Any) -> Any:
        if started.id == ids[1]:
            raise RuntimeError("a value nobody foresaw")
        return settle(kind, started, *args, **kwargs)

    delivery.settler.settle = refuses_one  # type: ignore[method-assign,assignment]
    try:
        claimed = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
        results = delivery.deliver_batch([(c.id, c.token) for c in claimed], family_hint="bulk")
    finally:
        del delivery.settler.settle
    assert seen == ids
    assert [r.outcome for r in results] == [Outcome.DELIVERED, Outcome.LOST] + [
        Outcome.DELIVERED
    ] * 3


def test_parked_operations_refuse_ids_and_limits_that_are_not_row_ids(
    dispatcher: Dispatcher,
) -> None:
    """They reached Postgres (a DatabaseError for 2**63 or limit -1) or were coerced ("1")."""
    for bad in (["1"], [True], [2**63], "12", 7):
        with pytest.raises(InvalidArgument, match="ids"):
            dispatcher.ops.parked_retry(ids=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="ids"):
            dispatcher.ops.parked_purge(ids=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="limit"):
        dispatcher.ops.parked_list(limit=-1)
    assert dispatcher.ops.parked_retry(ids=[]) == [] and dispatcher.ops.parked_list(limit=0) == []
