"""Existing Celery tasks through the outbox (``base=OutboxTask``): a call writes a row in the
caller's transaction, the delivery runs the task's own function; Celery's options, retries
and refusals mapped. Real Postgres, the session's Celery app and worker; deliveries run in
this process through ``drain`` where a test steps through attempts."""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, chord, group

from outbox_dispatch import (
    Dispatcher,
    EnqueuedTask,
    InvalidArgument,
    InvalidPayload,
    OutboxTask,
    OutsideTransaction,
    ResultsNotSupported,
    UnknownFamily,
    using,
)
from outbox_dispatch.celery.wiring import DELIVER_TASKS
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")

Calls = list[tuple[str, Any]]


@pytest.fixture
def calls() -> Calls:
    return []


@pytest.fixture
def task(celery_app: Celery, calls: Calls) -> Callable[..., Any]:
    """``task(fn, **options)``: a fresh task of the session's app on OutboxTask, whose body
    records its call in ``calls`` and then runs ``fn(self, *args, **kwargs)``."""

    def make(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        name = f"shop.t{uuid.uuid4().hex[:8]}"

        def body(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, {"args": args, "kwargs": kwargs, "request": self.request}))
            return fn(self, *args, **kwargs) if fn is not None else None

        return celery_app.task(name=name, base=OutboxTask, bind=True, **options)(body)

    return make


def _row(database_url: str, schema: str, row_id: int) -> dict[str, Any]:
    with (
        psycopg.connect(database_url) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        found = cur.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert found is not None, f"row {row_id} is gone"
    return found


@pytest.fixture
def tx(database_url: str) -> Iterator[Callable[[], Any]]:
    """``with tx():`` a psycopg transaction bound for task calls; commits at the end."""
    conns: list[psycopg.Connection[Any]] = []

    def open_tx() -> Any:
        from contextlib import ExitStack

        conn = psycopg.connect(database_url)
        conns.append(conn)
        stack = ExitStack()
        stack.enter_context(conn.transaction())
        stack.enter_context(using(conn))
        return stack

    yield open_tx
    for c in conns:
        c.close()


def _settle_all(dispatcher: Dispatcher, database_url: str, timeout: float = 10) -> None:
    """Drain until no row is pending (retries included), parked rows aside."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dispatcher.drain(timeout=5)
        where = "parked_at IS NULL AND done_at IS NULL AND cancelled_at IS NULL"
        if count_rows(database_url, dispatcher.schema, where) == 0:
            return
        time.sleep(0.05)
    raise AssertionError("rows still pending")


def test_a_call_in_a_transaction_runs_the_task_with_its_own_args_after_the_commit(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    add = task()
    when = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    key = uuid.uuid4()
    with tx():
        result = add.delay(2, Decimal("3.50"), when=when, key=key, tags=["a", "b"])
        # not visible from outside the transaction yet
        assert count_rows(database_url, dispatcher.schema) == 0
    assert isinstance(result, EnqueuedTask) and result.id == f"outbox:{result.row_id}"
    row = _row(database_url, dispatcher.schema, result.row_id)
    assert row["command"] == add.name and row["family"] == "job"
    dispatcher.drain(timeout=5)
    assert len(calls) == 1
    name, seen = calls[0]
    assert name == add.name
    # Celery's JSON serializer's types arrive as themselves
    assert seen["args"] == (2, Decimal("3.50"))
    assert seen["kwargs"] == {"when": when, "key": key, "tags": ["a", "b"]}
    request = seen["request"]
    assert request.id == result.id and request.retries == 0
    assert request.outbox.row_id == result.row_id and request.outbox.attempt == 1
    assert request.delivery_info["routing_key"] == "outbox.job"
    assert count_rows(database_url, dispatcher.schema) == 0  # delivered: deleted
    with pytest.raises(ResultsNotSupported, match="keeps no task results"):
        result.get(timeout=1)


def test_a_rolled_back_call_leaves_no_row_and_runs_nothing(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, database_url: str
) -> None:
    add = task()
    with psycopg.connect(database_url) as conn:
        with pytest.raises(RuntimeError), conn.transaction(), using(conn):
            add.delay(1)
            raise RuntimeError("the business change failed")
        # a SAVEPOINT rolled back inside a committed transaction takes its call with it
        with conn.transaction(), using(conn):
            with pytest.raises(RuntimeError), conn.transaction():
                add.delay(2)
                raise RuntimeError("inner")
            kept = add.delay(3)
    dispatcher.drain(timeout=5)
    assert [c[1]["args"] for c in calls] == [(3,)]
    assert count_rows(database_url, dispatcher.schema, f"id <> {kept.row_id}") == 0


def test_self_retry_retries_the_row_after_its_countdown_with_the_attempt_as_retries(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    def charge(self: Any, order: int) -> str:
        if self.request.retries < 2:
            raise self.retry(countdown=0.3, exc=ConnectionError(f"gateway down for {order}"))
        return "charged"

    charge_task = task(charge, max_retries=5)
    with tx():
        row_id = charge_task.delay(7).row_id
    dispatcher.drain(timeout=5)
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["attempts"] == 1 and row["parked_at"] is None and row["claim_token"] is None
    assert row["last_error"] == "ConnectionError: gateway down for 7 (retry 1 of 5)"
    with psycopg.connect(database_url) as conn:
        wait = conn.execute(
            f'SELECT extract(epoch FROM due_at - now()) FROM "{dispatcher.schema}".outbox'
        ).fetchone()
    assert wait is not None and 0.1 < float(wait[0]) <= 0.3
    _settle_all(dispatcher, database_url)
    assert [c[1]["request"].retries for c in calls] == [0, 1, 2]
    assert {c[1]["request"].id for c in calls} == {f"outbox:{row_id}"}  # one id, as Celery's
    assert count_rows(database_url, dispatcher.schema) == 0


def test_max_retries_exceeded_parks_the_row_with_the_tasks_error(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    def always(self: Any) -> None:
        raise self.retry(countdown=0, exc=TimeoutError("still down"))

    t = task(always, max_retries=1)
    with tx():
        row_id = t.delay().row_id
    _settle_all(dispatcher, database_url)
    row = _row(database_url, dispatcher.schema, row_id)
    assert len(calls) == 2  # the first run and its one retry, as Celery would
    assert row["parked_at"] is not None and row["attempts"] == 2
    assert "TimeoutError: still down (its max_retries (1) ran out)" in row["last_error"]


def test_autoretry_for_retries_listed_errors_and_parks_any_other(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    errors = [ConnectionError("reset"), KeyError("sku")]

    def fetch(self: Any) -> None:
        raise errors[len(calls) - 1]

    t = task(fetch, autoretry_for=(ConnectionError,), retry_backoff=False, default_retry_delay=0)
    with tx():
        row_id = t.delay().row_id
    _settle_all(dispatcher, database_url)
    row = _row(database_url, dispatcher.schema, row_id)
    assert len(calls) == 2 and row["parked_at"] is not None
    assert "KeyError: 'sku' (not retried: the task did not call self.retry" in row["last_error"]


def test_countdown_eta_and_expires_become_the_rows_due_time_and_expiry(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    calls: Calls,
    tx: Any,
    database_url: str,
    celery_app: Celery,
) -> None:
    t = task()
    naive = datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=2)
    with tx():
        later = t.apply_async((1,), countdown=30).row_id
        at = t.apply_async((2,), eta=naive).row_id  # naive: the app's timezone (UTC here)
        gone = t.apply_async((3,), expires=datetime.now(UTC) - timedelta(seconds=1)).row_id
        fresh = t.apply_async((4,), expires=60).row_id
    with psycopg.connect(database_url) as conn:
        due: dict[int, Any] = dict(
            conn.execute(
                f'SELECT id, extract(epoch FROM due_at - now()) FROM "{dispatcher.schema}".outbox'
            ).fetchall()
        )
    assert 25 < float(due[later]) <= 30
    assert abs(float(due[at]) - 7200) < 60
    assert celery_app.timezone.utcoffset(naive) == timedelta(0)
    dispatcher.drain(timeout=5)
    # the expired call is settled without running; the fresh one runs
    assert [c[1]["args"] for c in calls] == [(4,)]
    assert count_rows(database_url, dispatcher.schema, f"id IN ({gone}, {fresh})") == 0


def _two(a: int, b: int) -> int:
    return a + b


def test_what_cannot_map_is_refused_at_the_call_and_writes_nothing(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    tx: Any,
    database_url: str,
    celery_app: Celery,
) -> None:
    a, b = task(), task()
    with tx():
        with pytest.raises(InvalidArgument, match=r"link=\.\.\.\) is refused: callbacks"):
            a.apply_async((1,), link=b.s())
        with pytest.raises(InvalidArgument, match="refused"):
            chain(a.s(1), b.s()).delay()
        with pytest.raises(InvalidArgument, match="groups collect"):
            group(a.s(1), a.s(2)).delay()
        with pytest.raises(InvalidArgument, match="time_limit"):
            a.apply_async((1,), time_limit=5)
        with pytest.raises(InvalidArgument, match="does not know"):
            a.apply_async((1,), colour="red")
        with pytest.raises(InvalidArgument, match="countdown or eta, not both"):
            a.apply_async((1,), countdown=1, eta=datetime.now(UTC))
        with pytest.raises(InvalidPayload, match="cannot be written as JSON"):
            a.delay(object())
        typed = celery_app.task(name=f"shop.typed{uuid.uuid4().hex[:6]}", base=OutboxTask)(_two)
        with pytest.raises(TypeError):  # Celery's own argument check, at the call
            typed.delay(1)
    assert count_rows(database_url, dispatcher.schema) == 0


def test_a_chord_is_refused_at_the_call(
    database_url: str, redis_url: str, schema: str, key_prefix: str, tx: Any
) -> None:
    # Celery refuses chords itself without a result backend: this app has one
    app = Celery("chords", broker=redis_url, backend=redis_url, set_as_current=False)
    prefix = {"global_keyprefix": key_prefix}
    app.conf.update(broker_transport_options=prefix, result_backend_transport_options=prefix)
    dispatcher = Dispatcher(app, database_url=database_url, schema=schema)

    def step(n: Any) -> Any:
        return n

    head = app.task(name="chords.head", base=OutboxTask)(step)
    body = app.task(name="chords.body", base=OutboxTask)(step)
    with tx(), pytest.raises(InvalidArgument, match="chords wait for a group's results"):
        chord([head.s(1)], body.s()).delay()
    assert count_rows(database_url, schema) == 0
    dispatcher.close()


def test_outside_a_transaction_commit_raise_or_plain_celery(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    calls: Calls,
    database_url: str,
    published: list[dict[str, Any]],
) -> None:
    committed = task()  # the default: its row commits at once, as a plain call publishes
    row_id = committed.delay(1).row_id
    strict = task(outbox_outside="raise")
    with pytest.raises(OutsideTransaction, match="outside a transaction"):
        strict.delay(2)
    # beat's periodic calls never have a transaction: they commit even under "raise"
    beat = strict.apply_async((4,), headers={"celery_beat_task": True})
    assert isinstance(beat, EnqueuedTask)
    plain = task(outbox_outside="celery")
    result = plain.delay(3)
    assert not isinstance(result, EnqueuedTask)
    assert [p["task"] for p in published if p["task"] == plain.name] == [plain.name]
    assert count_rows(database_url, dispatcher.schema, f"command = '{plain.name}'") == 0
    # the committed row was visible to others at once: delivered here, or by the session's
    # worker when its claim wake (listen=False) got there first
    dispatcher.drain(timeout=5)
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(c[1]["args"] for c in calls) == [(1,), (4,)]
    # settled after their handlers returned (a worker's settles are deferred a few ms)
    delivered = f"id IN ({row_id}, {beat.row_id})"
    while count_rows(database_url, dispatcher.schema, delivered) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert count_rows(database_url, dispatcher.schema, delivered) == 0


def test_a_task_opted_out_is_plain_celery_even_inside_a_transaction(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    tx: Any,
    database_url: str,
    published: list[dict[str, Any]],
) -> None:
    t = task(outbox=False)
    with tx():
        result = t.delay(1)
    assert not isinstance(result, EnqueuedTask)
    assert [p["task"] for p in published] == [t.name]
    assert count_rows(database_url, dispatcher.schema) == 0


def test_queue_and_routes_pick_the_family_and_an_unknown_queue_is_refused(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    tx: Any,
    database_url: str,
    celery_app: Celery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with warnings.catch_warnings():  # Celery 5.7 deprecates the queue attribute; shops use it
        warnings.simplefilter("ignore")
        on_queue = task(queue="quick")
    named = task(outbox_family="bulk")
    routed = task()
    # task_routes as a shop's settings would set them, before the router is built
    amqp = celery_app.amqp
    monkeypatch.setitem(celery_app.conf, "task_routes", {routed.name: {"queue": "plain"}})
    monkeypatch.setattr(amqp, "_rtable", None)
    monkeypatch.setattr(amqp, "router", amqp.Router())
    with tx():
        ids = {
            "quick": on_queue.delay().row_id,
            "bulk": named.delay().row_id,
            "plain": routed.delay().row_id,
            "intent": on_queue.apply_async(queue="intent").row_id,  # the call's queue wins
            "job": task().delay().row_id,  # the default queue: the dispatcher's task_family
        }
        with pytest.raises(UnknownFamily, match="routed to queue 'mail', which is no outbox"):
            on_queue.apply_async(queue="mail")
    for family, row_id in ids.items():
        assert _row(database_url, dispatcher.schema, row_id)["family"] == family
    assert count_rows(database_url, dispatcher.schema) == len(ids)


def test_a_task_id_is_the_calls_dedupe_key_and_its_request_id(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    t = task()
    with tx():
        first = t.apply_async((1,), task_id="receipt-42")
        again = t.apply_async((1,), task_id="receipt-42")
    assert first.row_id == again.row_id and first.id == "receipt-42"
    dispatcher.drain(timeout=5)
    assert [c[1]["request"].id for c in calls] == ["receipt-42"]


def test_always_eager_runs_the_task_inline_as_celery_does(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    calls: Calls,
    database_url: str,
    celery_app: Celery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(celery_app.conf, "task_always_eager", True)
    t = task()
    t.delay(5)
    assert [c[1]["args"] for c in calls] == [(5,)]
    assert count_rows(database_url, dispatcher.schema) == 0


def test_the_worker_delivers_a_call_under_the_tasks_own_name(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    calls: Calls,
    tx: Any,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    t = task()
    with tx():
        row_id = t.delay("hello").row_id
    dispatcher.runtime.claim_and_publish(["job"])
    deadline = time.monotonic() + 20
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [c[1]["args"] for c in calls] == [("hello",)]
    shown = [p["headers"].get("shadow") for p in published if p["task"] in DELIVER_TASKS]
    assert shown == [t.name]
    sent = next(p for p in published if p["task"] in DELIVER_TASKS)
    assert sent["body"][0][0] == row_id  # the message names the row, not the args


def test_found_by_review_retries_timeouts_and_ids_behave_as_in_celery(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    calls: Calls,
    tx: Any,
    database_url: str,
    published: list[dict[str, Any]],
) -> None:
    from billiard.exceptions import SoftTimeLimitExceeded  # type: ignore[import-untyped]

    from outbox_dispatch import RetryLater

    # self.retry(throw=False) returns its Retry; the task's return must not deliver the row
    def quiet_retry(self: Any) -> None:
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)

    def later(self: Any) -> None:
        if self.request.retries == 0:
            raise RetryLater(0.0, "the provider said 429")

    def slow(self: Any) -> None:
        if self.request.retries == 0:
            raise SoftTimeLimitExceeded()  # a prefork pool's soft time limit: retried, as any

    rows = {}
    with tx():
        for name, fn in (("quiet", quiet_retry), ("later", later), ("slow", slow)):
            rows[name] = task(fn, max_retries=3).delay().row_id
    _settle_all(dispatcher, database_url)
    runs = {n: sum(1 for c in calls if c[1]["request"].outbox.row_id == r) for n, r in rows.items()}
    assert runs == {"quiet": 2, "later": 2, "slow": 2}  # each retried once, none parked
    assert count_rows(database_url, dispatcher.schema, "parked_at IS NOT NULL") == 0

    # a task_id dedupes calls of its own task only; the task still sees the bare id
    a, b = task(), task()
    with tx():
        first = a.apply_async(task_id="order-7")
        other = b.apply_async(task_id="order-7")
    assert first.row_id != other.row_id and first.id == other.id == "order-7"
    calls.clear()
    dispatcher.drain(timeout=5)
    assert sorted(c[1]["request"].id for c in calls) == ["order-7", "order-7"]

    # Celery's own retry of a call that ran as plain Celery republishes through Celery
    plain = task(outbox_outside="celery")
    sent = plain.apply_async((1,), retries=1, reply_to="celery@host", countdown=0)
    assert not isinstance(sent, EnqueuedTask)
    assert [p["task"] for p in published] == [plain.name]


def test_using_an_autocommit_connection_is_outside_a_transaction(
    dispatcher: Dispatcher, task: Callable[..., Any], database_url: str
) -> None:
    strict = task(outbox_outside="raise")
    with psycopg.connect(database_url, autocommit=True) as conn, using(conn):
        with pytest.raises(OutsideTransaction, match="outside a transaction"):
            strict.delay()
        row_id = task().delay().row_id  # the default: committed on its own, at once
    assert count_rows(database_url, dispatcher.schema, f"id = {row_id}") == 1


def test_a_dedupe_key_held_by_another_task_is_refused_and_ids_match(
    dispatcher: Dispatcher, task: Callable[..., Any], calls: Calls, tx: Any, database_url: str
) -> None:
    a, b = task(), task()
    with tx():
        mine = a.apply_async((1,), dedupe_key="order:9")
        again = a.apply_async((1,), dedupe_key="order:9")  # the same task: the same row
        with pytest.raises(InvalidArgument, match=r"is held by row .* give each task"):
            b.apply_async((2,), dedupe_key="order:9")
    assert again.row_id == mine.row_id
    dispatcher.drain(timeout=5)
    assert [c[1]["request"].id for c in calls] == [mine.id]  # the id the call returned
    with tx(), pytest.raises(UnknownFamily, match="no outbox family can be"):
        a.apply_async(queue="Emails")
    with tx(), pytest.raises(UnknownFamily, match="claim queue is the outbox's own"):
        a.apply_async(queue="outbox.claim")


def test_an_expiry_of_nan_seconds_is_refused_at_the_call(
    task: Callable[..., Any], tx: Any, database_url: str, schema: str
) -> None:
    """It escaped as a raw ValueError from timedelta; now InvalidArgument, and no row."""
    t = task()
    with tx(), pytest.raises(InvalidArgument, match="expires"):
        t.apply_async((1,), expires=float("nan"))
    assert count_rows(database_url, schema) == 0
