"""Django's tasks framework (DEP 0014) on the outbox (contrib/django/tasks.py): a ``@task``
function's ``.enqueue()`` in ``transaction.atomic()`` writes its row on Django's connection in
that transaction, and the Dispatcher runs the function; what cannot map is refused. On the real
Postgres with the test project (tests/django_project, whose TASKS names the backend), a
Dispatcher and schema of this module's own, its rows delivered by ``drain()``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from celery import Celery
from django.db import connection, connections, transaction
from django.test.utils import override_settings
from django.utils import timezone

from outbox_dispatch import Backoff, Dispatcher
from outbox_dispatch.celery.wiring import CLAIM_TASK
from outbox_dispatch.contrib.django import NotInTransaction
from outbox_dispatch.contrib.django.tasks import (
    BACKEND,
    OutboxBackend,
    ResultsNotKept,
    TaskRefused,
    UnknownQueue,
)
from outbox_dispatch.store.migrations import migrate
from tests.support.django_setup import _served

if TYPE_CHECKING:
    from django_tasks import task, task_backends
    from django_tasks.base import Task
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.signals import task_enqueued, task_finished, task_started
else:
    try:  # Django 6
        from django.tasks import task, task_backends
        from django.tasks.base import Task
        from django.tasks.exceptions import InvalidTask
        from django.tasks.signals import task_enqueued, task_finished, task_started
    except ImportError:  # the django-tasks backport
        from django_tasks import task, task_backends
        from django_tasks.base import Task
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.signals import task_enqueued, task_finished, task_started

HERE = __name__  # tests.adoption.test_django_tasks: the commands are its functions' paths

# What the task functions below ran with, in order: (function, args, kwargs).
calls: list[tuple[str, list[Any], dict[str, Any]]] = []


def record(*args: Any, **kwargs: Any) -> None:
    calls.append(("record", list(args), kwargs))


async def arecord(n: int) -> None:
    await asyncio.sleep(0)
    calls.append(("arecord", [n], {}))


def with_context(context: Any, n: int) -> None:
    calls.append(("with_context", [context.task_result.id, context.attempt, n], {}))


def fails(n: int) -> None:
    calls.append(("fails", [n], {}))
    raise ValueError(f"no {n}")


FUNCTIONS = ("record", "arecord", "with_context", "fails")


def _tasks_setting(**options: Any) -> dict[str, Any]:
    """The test project's TASKS, with ``options`` over its backend's OPTIONS (and QUEUES)."""
    queues = options.pop("QUEUES", ["default", "emails"])
    return {
        "default": {
            "BACKEND": BACKEND,
            "QUEUES": queues,
            "OPTIONS": {"FAMILY": "django_tasks", **options},
        }
    }


@pytest.fixture(scope="module")
def outbox(order_model: Any, database_url: str, run_id: str) -> Iterator[Dispatcher]:
    """The Dispatcher OUTBOX_DISPATCHER names for this module: its own schema (so that no
    other test's worker claims these rows) and the families TASKS maps the queues to."""
    schema = f"od_test_{run_id}_djtasks"
    migrate(database_url, schema)
    app = Celery("outbox_tests_django_tasks", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url=database_url, schema=schema, listen=False)
    d.family("django_tasks", max_attempts=2, backoff=Backoff(0.05, 0.05, 0.0), lease=10)
    d.family("emails")
    try:
        with _served("django_tasks_outbox", d):
            yield d
    finally:
        d.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(scope="module")
def tasks(outbox: Dispatcher) -> SimpleNamespace:
    """This module's functions made Tasks by the framework's ``@task``, as decorating them
    does, now that Django is set up (``@task`` reads settings.TASKS); each name then holds its
    Task, where the worker side finds it by the row's command."""
    made = {}
    for name in FUNCTIONS:
        current = globals()[name]
        if not isinstance(current, Task):
            takes = name == "with_context"
            current = task(takes_context=True)(current) if takes else task(current)
        made[name] = globals()[name] = current
    return SimpleNamespace(**made)


@pytest.fixture(autouse=True)
def empty(outbox: Dispatcher) -> None:
    calls.clear()
    with psycopg.connect(outbox.database_url, autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{outbox.schema}".outbox')


def _rows(d: Dispatcher) -> list[dict[str, Any]]:
    """The committed rows, as another session sees them."""
    with psycopg.connect(d.database_url) as conn:
        cur = conn.execute(
            f'SELECT id, command, family, payload, due_at FROM "{d.schema}".outbox ORDER BY id'
        )
        names = [c.name for c in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur]


def _wakes(published: list[dict[str, Any]]) -> list[str]:
    """The families of the claim wakes sent (the body is ((families,), {}, embed))."""
    return [f for m in published if m["task"] == CLAIM_TASK for f in m["body"][0][0]]


# -- enqueue in a transaction, run by the Dispatcher ------------------------------------------


def test_enqueue_in_atomic_writes_one_row_that_commits_with_the_order_and_runs_once(
    orders: Any, outbox: Dispatcher, tasks: SimpleNamespace, published: list[dict[str, Any]]
) -> None:
    seen: list[tuple[str, str, str]] = []  # the framework's signals, as they were sent

    def receiver(name: str) -> Any:
        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, task_result.id, str(task_result.status)))

        return receive

    receivers = [
        (task_enqueued, receiver("enqueued")),
        (task_started, receiver("started")),
        (task_finished, receiver("finished")),
    ]
    for signal, fn in receivers:
        signal.connect(fn, weak=False)
    try:
        with transaction.atomic():
            order = orders.objects.create(customer="ada", total_cents=4200)
            result = tasks.record.enqueue(order.pk, note="receipt")
            assert _rows(outbox) == []  # nobody sees the row before the commit
            assert _wakes(published) == []
        (row,) = _rows(outbox)
        assert (row["command"], row["family"]) == (f"{HERE}.record", "django_tasks")
        assert row["payload"] == {"args": [order.pk], "kwargs": {"note": "receipt"}}
        assert result.id == f"outbox:{row['id']}"
        assert (result.status, result.backend, result.args) == ("READY", "default", [order.pk])
        assert _wakes(published) == ["django_tasks"]  # listen=False: a claim wake at commit
        assert calls == []

        report = outbox.drain(timeout=30)
        assert report.delivered == 1
        assert calls == [("record", [order.pk], {"note": "receipt"})]
        assert outbox.drain(timeout=30).delivered == 0
        assert len(calls) == 1  # once
        assert _rows(outbox) == []  # delivered (the family keeps no settled rows)
    finally:
        for signal, fn in receivers:
            signal.disconnect(fn)
    assert seen == [
        ("enqueued", result.id, "READY"),
        ("started", result.id, "RUNNING"),
        ("finished", result.id, "SUCCESSFUL"),
    ]


def test_a_rolled_back_block_leaves_no_row_and_the_function_never_runs(
    orders: Any, outbox: Dispatcher, tasks: SimpleNamespace, published: list[dict[str, Any]]
) -> None:
    with pytest.raises(RuntimeError, match="declined"), transaction.atomic():
        order = orders.objects.create(customer="bob", total_cents=100)
        tasks.record.enqueue(order.pk)
        raise RuntimeError("card declined")
    assert orders.objects.count() == 0
    assert _rows(outbox) == []
    assert _wakes(published) == []
    assert outbox.drain(timeout=30).delivered == 0
    assert calls == []


def test_a_queue_is_the_family_of_its_name(outbox: Dispatcher, tasks: SimpleNamespace) -> None:
    with transaction.atomic():
        tasks.record.using(queue_name="emails").enqueue("to@example.com")
    assert [r["family"] for r in _rows(outbox)] == ["emails"]
    assert outbox.drain(timeout=30).delivered == 1
    assert calls == [("record", ["to@example.com"], {})]


def test_a_task_that_takes_context_sees_its_result_id_and_attempt(
    outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    with transaction.atomic():
        result = tasks.with_context.enqueue(5)
    assert outbox.drain(timeout=30).delivered == 1
    assert calls == [("with_context", [result.id, 1, 5], {})]


def test_an_async_task_runs_and_a_failing_one_is_retried_by_its_family(
    outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    failed: list[tuple[str, list[str]]] = []

    def finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        paths = [e.exception_class_path for e in task_result.errors]
        failed.extend([(str(task_result.status), paths)] if paths else [])

    task_finished.connect(finished, weak=False)
    try:
        with transaction.atomic():
            tasks.arecord.enqueue(6)
            tasks.fails.enqueue(7)
        assert outbox.drain(timeout=30).delivered == 1  # the async one
        time.sleep(0.2)  # the failing one's retry (family django_tasks: max_attempts=2)
        outbox.drain(timeout=30)
    finally:
        task_finished.disconnect(finished)
    assert calls.count(("arecord", [6], {})) == 1
    assert calls.count(("fails", [7], {})) == 2
    assert failed == [("FAILED", ["builtins.ValueError"])] * 2
    with psycopg.connect(outbox.database_url) as conn:
        parked = conn.execute(
            f'SELECT last_error FROM "{outbox.schema}".outbox WHERE parked_at IS NOT NULL'
        ).fetchall()
    assert len(parked) == 1 and "no 7" in parked[0][0]


# -- aenqueue ---------------------------------------------------------------------------------


def test_aenqueue_joins_the_atomic_block_of_the_thread_it_was_awaited_from(
    orders: Any, outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    """Django's async-safe path: async_to_sync here, and the backend's
    sync_to_async(thread_sensitive=True) inside, bring the write back to this thread, whose
    connection is in the atomic block."""
    with transaction.atomic():
        order = orders.objects.create(customer="cy", total_cents=1)
        result = async_to_sync(tasks.record.aenqueue)(order.pk)
        assert _rows(outbox) == []
    (row,) = _rows(outbox)
    assert result.id == f"outbox:{row['id']}"
    with pytest.raises(RuntimeError), transaction.atomic():
        async_to_sync(tasks.record.aenqueue)(-1)
        raise RuntimeError("rolled back")
    assert len(_rows(outbox)) == 1
    assert outbox.drain(timeout=30).delivered == 1
    assert calls == [("record", [order.pk], {})]


def test_aenqueue_under_asyncio_run_is_refused_outside_a_transaction_unless_allowed(
    outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    """A coroutine on a loop of its own (asyncio.run) has no transaction: the backend runs
    the write in Django's sync thread for async code, which is in none, so it is refused,
    also inside this thread's atomic block, which that thread cannot see. With
    ALLOW_AUTOCOMMIT the row commits on its own."""

    async def call(n: int) -> Any:
        return await tasks.record.aenqueue(n)

    try:
        with pytest.raises(NotInTransaction, match="ALLOW_AUTOCOMMIT"):
            asyncio.run(call(1))
        with transaction.atomic(), pytest.raises(NotInTransaction):
            asyncio.run(call(2))
        assert _rows(outbox) == []
        with override_settings(TASKS=_tasks_setting(ALLOW_AUTOCOMMIT=True)):
            result = asyncio.run(call(3))
        (row,) = _rows(outbox)  # committed at once
        assert result.id == f"outbox:{row['id']}"
        assert outbox.drain(timeout=30).delivered == 1
        assert calls == [("record", [3], {})]
    finally:
        # the connection Django opened in asgiref's thread for sync code
        asyncio.run(sync_to_async(connections.close_all)())


# -- run_after --------------------------------------------------------------------------------


def test_run_after_is_the_row_due_time(
    outbox: Dispatcher, tasks: SimpleNamespace, published: list[dict[str, Any]]
) -> None:
    when = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        result = tasks.record.using(run_after=when).enqueue(8)
    (row,) = _rows(outbox)
    assert row["due_at"] == when
    assert result.task.run_after == when
    assert _wakes(published) == []  # nothing due: nothing to wake
    assert outbox.drain(timeout=30).delivered == 0
    assert calls == []


# -- what cannot map --------------------------------------------------------------------------


def test_a_queue_that_is_no_declared_family_is_refused(
    outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    # not among the backend's QUEUES: the framework's own refusal, at .using()
    with pytest.raises(InvalidTask, match="Queue 'nowhere' is not valid"):
        tasks.record.using(queue_name="nowhere")
    with override_settings(TASKS=_tasks_setting(QUEUES=["default", "nowhere", "Not-A-Family"])):
        with pytest.raises(TaskRefused, match="'Not-A-Family' cannot be an outbox family"):
            tasks.record.using(queue_name="Not-A-Family")
        with transaction.atomic():
            with pytest.raises(UnknownQueue, match=r"dispatcher\.family\('nowhere'\)") as refused:
                tasks.record.using(queue_name="nowhere").enqueue(1)
            tasks.record.enqueue(2)  # the transaction goes on: nothing was written
        problems = list(task_backends["default"].check())  # manage.py check says it too
    assert isinstance(refused.value, InvalidTask)
    assert "its queue 'nowhere' is the family of that name, which the Dispatcher does not " in (
        str(refused.value)
    )
    assert [r["payload"]["args"] for r in _rows(outbox)] == [[2]]
    assert {m.id for m in problems} == {"outbox_dispatch.E102"}
    assert sorted(
        "'Not-A-Family' cannot be an outbox family" in m.msg or "queue 'nowhere' is the" in m.msg
        for m in problems
    ) == [True, True]

    # the default queue's family, when the Dispatcher does not declare it
    with override_settings(TASKS=_tasks_setting(FAMILY="undeclared")), transaction.atomic():
        with pytest.raises(UnknownQueue, match=r"OPTIONS'\]\['FAMILY'\]"):
            tasks.record.enqueue(3)
    assert len(_rows(outbox)) == 1


def test_a_priority_is_refused(outbox: Dispatcher, tasks: SimpleNamespace) -> None:
    with pytest.raises(TaskRefused, match="the outbox has no priorities") as refused:
        tasks.record.using(priority=10)
    assert isinstance(refused.value, InvalidTask)
    with pytest.raises(TaskRefused, match="asks for priority -5"):
        task(priority=-5)(tasks.record.func)
    assert OutboxBackend.supports_priority is False


def test_results_are_refused(outbox: Dispatcher, tasks: SimpleNamespace) -> None:
    with transaction.atomic():
        result = tasks.record.enqueue(9)
    assert OutboxBackend.supports_get_result is False
    with pytest.raises(ResultsNotKept, match="keeps no results") as refused:
        tasks.record.get_result(result.id)
    assert isinstance(refused.value, NotImplementedError)  # the framework's "not supported"
    with pytest.raises(ResultsNotKept):
        result.refresh()
    with pytest.raises(ResultsNotKept):
        asyncio.run(tasks.record.aget_result(result.id))


def test_enqueue_outside_a_transaction_is_refused_unless_the_option_allows_it(
    outbox: Dispatcher, tasks: SimpleNamespace
) -> None:
    assert connection.get_autocommit()
    with pytest.raises(NotInTransaction, match="outside a transaction") as refused:
        tasks.record.enqueue(10)
    assert "TASKS['default']['OPTIONS']['ALLOW_AUTOCOMMIT'] = True" in str(refused.value)
    assert _rows(outbox) == []
    with override_settings(TASKS=_tasks_setting(ALLOW_AUTOCOMMIT=True)):
        tasks.record.enqueue(11)
    assert [r["payload"]["args"] for r in _rows(outbox)] == [[11]]  # committed on its own
    assert outbox.drain(timeout=30).delivered == 1
    assert calls == [("record", [11], {})]


# -- the worker side --------------------------------------------------------------------------


def test_a_worker_that_never_enqueued_runs_the_rows_once_the_system_checks_ran(
    outbox: Dispatcher, tasks: SimpleNamespace, database_url: str
) -> None:
    """A worker's Dispatcher knows no Django task until the backend serves it: Celery's
    Django fixup runs the system checks as the worker starts, and the backend's check serves
    the Dispatcher OUTBOX_DISPATCHER names."""
    with transaction.atomic():
        tasks.record.enqueue(12)
    app = Celery("outbox_tests_django_tasks_worker", broker="memory://", set_as_current=False)
    worker = Dispatcher(app, database_url=database_url, schema=outbox.schema, listen=False)
    worker.family("django_tasks")
    worker.family("emails")
    try:
        assert worker.registry.registration(f"{HERE}.record") is None
        with _served(f"django_tasks_worker_{uuid.uuid4().hex[:6]}", worker):
            assert list(task_backends["default"].check()) == []
        reg = worker.registry.registration(f"{HERE}.record")
        assert reg is not None and reg.task and reg.family == "django_tasks"
        assert worker.registry.registration(f"{HERE}.nothing") is None
        assert worker.registry.registration("email.receipt") is None  # not a task's path
        assert worker.drain(timeout=30).delivered == 1
        assert calls == [("record", [12], {})]
    finally:
        worker.close()
