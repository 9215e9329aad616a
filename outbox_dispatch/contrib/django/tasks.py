"""Django's tasks framework (DEP 0014) on the outbox: with ``TASKS = {"default": {"BACKEND":
"outbox_dispatch.contrib.django.tasks.OutboxBackend"}}`` a ``@task`` function's ``.enqueue()``
(or ``.aenqueue()``) writes an outbox row on Django's connection, in its current transaction,
and the Celery workers run the function. ``django.tasks`` (Django 6) is used when it is there,
else the ``django-tasks`` backport. docs/django.md says how a task maps onto a row (the module
path is the command, the queue the family, ``run_after`` the due time) and what is refused
(priorities, undeclared queues, results, a call outside a transaction). ``serve(dispatcher)``
lets the worker's Dispatcher find a task by its rows' command.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import traceback
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage
from django.core.checks import Error as CheckError
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from outbox_dispatch.celery.transactions import wake_on_commit
from outbox_dispatch.contrib.django import NotInTransaction
from outbox_dispatch.contrib.django.apps import SETTING, get_dispatcher
from outbox_dispatch.core.errors import (
    InvalidIdentifier,
    OutboxError,
    PermanentFailure,
    ResultsNotSupported,
    UnknownFamily,
)
from outbox_dispatch.core.handlers import Context, Registration
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.naming import family_name
from outbox_dispatch.observe import tracing

if TYPE_CHECKING:  # the backport's annotations; at run time, whichever the else picks
    from django_tasks import DEFAULT_TASK_QUEUE_NAME, signals
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import (
        DEFAULT_TASK_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django_tasks.exceptions import InvalidTaskError as InvalidTask

    from outbox_dispatch.dispatcher import Dispatcher
else:
    try:  # Django 6
        from django.tasks import DEFAULT_TASK_QUEUE_NAME, signals
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import (
            DEFAULT_TASK_PRIORITY,
            Task,
            TaskContext,
            TaskError,
            TaskResult,
            TaskResultStatus,
        )
        from django.tasks.exceptions import InvalidTask
    except ImportError:  # before Django 6: the django-tasks backport of the same API
        from django_tasks import DEFAULT_TASK_QUEUE_NAME, signals
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import (
            DEFAULT_TASK_PRIORITY,
            Task,
            TaskContext,
            TaskError,
            TaskResult,
            TaskResultStatus,
        )
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

__all__ = [
    "NotInTransaction",
    "OutboxBackend",
    "ResultsNotKept",
    "TaskRefused",
    "UnknownQueue",
    "resolve_task",
    "serve",
]

log = logging.getLogger(__name__)

APP = "outbox_dispatch.contrib.django"
BACKEND = "outbox_dispatch.contrib.django.tasks.OutboxBackend"
OPTIONS = ("FAMILY", "DATABASE", "ALLOW_AUTOCOMMIT")


class TaskRefused(OutboxError, InvalidTask):
    """A task the outbox cannot carry as it is asked to (a priority, a queue no family can
    be): the framework's ``InvalidTask``, said in the outbox's terms."""


class UnknownQueue(TaskRefused, UnknownFamily):
    """A task's queue names no family the Dispatcher declares: its rows would wait on a queue
    no worker consumes. Declare the family, or send the task to a declared one."""


class ResultsNotKept(ResultsNotSupported, NotImplementedError):
    """The outbox keeps a task call (its row), not what the task returned: there is no
    result to get. Store the outcome where the task can write it (a model, a cache)."""


class OutboxBackend(BaseTaskBackend):
    """``TASKS = {"default": {"BACKEND": "outbox_dispatch.contrib.django.tasks.OutboxBackend",
    "QUEUES": [...], "OPTIONS": {...}}}``.

    ``QUEUES``: the queues tasks may name (the framework's default: ``["default"]``); each
    other than ``default`` is the outbox family of the same name. ``OPTIONS``: ``FAMILY``,
    the family of the ``default`` queue (default: the Dispatcher's ``task_family``);
    ``DATABASE``, the Django database alias the rows are written on (``"default"``);
    ``ALLOW_AUTOCOMMIT``, write a row outside a transaction, committed on its own (False).
    """

    supports_defer = True  # run_after: the row's due time
    supports_async_task = True  # an async function runs as the framework runs it (task.call)
    supports_get_result = False  # the outbox keeps no results
    supports_priority = False  # a family's due rows run in due order

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        where = f"TASKS[{alias!r}]['OPTIONS']"
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ImproperlyConfigured(
                f"{where} has {', '.join(map(repr, unknown))}: {BACKEND} knows "
                f"{', '.join(map(repr, OPTIONS))}"
            )
        family = self.options.get("FAMILY")
        if family is not None:
            try:
                family_name(family)
            except InvalidIdentifier as exc:
                raise ImproperlyConfigured(f"{where}['FAMILY']: {exc}") from exc
        database = self.options.get("DATABASE", DEFAULT_DB_ALIAS)
        if not isinstance(database, str) or not database:
            raise ImproperlyConfigured(
                f"{where}['DATABASE'] must name a database of settings.DATABASES, got {database!r}"
            )
        allow = self.options.get("ALLOW_AUTOCOMMIT", False)
        if not isinstance(allow, bool):
            raise ImproperlyConfigured(f"{where}['ALLOW_AUTOCOMMIT'] must be True or False")
        self.default_family: str | None = family
        self.database: str = database
        self.allow_autocommit: bool = allow

    # -- what can map ------------------------------------------------------------------------

    def validate_task(self, task: Task[Any, Any]) -> None:
        """The framework's checks (at ``@task``, ``.using()`` and each enqueue), with a
        priority and a queue no family can be refused in the outbox's terms first. Reads no
        Dispatcher: this runs as modules import."""
        if task.priority != DEFAULT_TASK_PRIORITY:
            raise TaskRefused(
                f"{task.module_path} asks for priority {task.priority}: the outbox has no "
                "priorities (a family's due rows run in the order they are due), so "
                f"{BACKEND} does not take one. Leave priority at {DEFAULT_TASK_PRIORITY}, or "
                "give urgent work a queue of its own (queue_name=...) named after a family "
                "with workers of its own"
            )
        if task.queue_name != DEFAULT_TASK_QUEUE_NAME:
            self._family_name(task.queue_name, task.module_path)
        super().validate_task(task)

    def family_for(self, queue_name: str, dispatcher: Dispatcher, what: str = "a task") -> str:
        """The outbox family of a task queue, refused unless ``dispatcher`` declares it."""
        if queue_name == DEFAULT_TASK_QUEUE_NAME:
            family = self.default_family or dispatcher.settings.task_family
            came = (
                f"TASKS[{self.alias!r}]['OPTIONS']['FAMILY']"
                if self.default_family
                else "the Dispatcher's task_family (set OPTIONS['FAMILY'] to choose another)"
            )
            source = f"queue {queue_name!r} goes to family {family!r}, from {came}"
        else:
            family = self._family_name(queue_name, what)
            source = f"queue {queue_name!r} is the family of that name"
        if family not in dispatcher.families:
            raise UnknownQueue(
                f"{what} cannot be enqueued: its {source}, which the Dispatcher does not "
                f"declare, so no worker would consume its rows. Declare it where the "
                f"Dispatcher is built, dispatcher.family({family!r}) (its workers consume "
                f"{dispatcher.queue_name(family)!r}), or use a declared family "
                f"({', '.join(sorted(dispatcher.families))})"
            )
        return family

    def _family_name(self, queue_name: str, what: str) -> str:
        try:
            return family_name(queue_name)
        except InvalidIdentifier:
            raise TaskRefused(
                f"{what}: queue {queue_name!r} cannot be an outbox family, whose names are "
                "1-48 lower-case letters, digits or _, starting with a letter: name the queue "
                "after the family its rows go to"
            ) from None

    # -- enqueue -------------------------------------------------------------------------------

    def enqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any]:
        """Write the call's outbox row on ``connections[OPTIONS["DATABASE"]]`` in its current
        transaction (it commits or rolls back with it); a commit wakes the claimer as
        ``contrib.django.enqueue`` does."""
        self.validate_task(task)
        dispatcher = get_dispatcher()
        serve(dispatcher)
        family = self.family_for(task.queue_name, dispatcher, task.module_path)
        connection = self._transaction(task)
        result: TaskResult[Any] = TaskResult(  # normalizes args and kwargs to JSON
            task=task,
            id="",
            status=TaskResultStatus("READY"),
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        at = _aware(task.run_after)
        payload = {"args": result.args, "kwargs": result.kwargs}
        trace = tracing.current_context_json()
        row = dispatcher.writer.row(
            task.module_path, payload, None, None, None, at, family, trace_json=trace
        )
        # the Writer, not dispatcher.enqueue: the family is the call's (its task's queue),
        # not one per command, as for Celery task calls (celery/tasks.py write_call)
        row_id = dispatcher.writer.write(connection, row, None)
        if at is None:
            wake_on_commit(connection, dispatcher, [family])
        database = dispatcher.database_of(connection).name
        result = replace(result, id=result_id(database, row_id), enqueued_at=timezone.now())
        signals.task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any]:
        """``enqueue`` run as Django runs its ORM from async code: in the thread that holds
        this context's connection (``sync_to_async(thread_sensitive=True)``), so the row joins
        the transaction that thread is in, and is refused when it is in none."""
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)

    def _transaction(self, task: Task[Any, Any]) -> Any:
        """Django's connection, checked to be in a transaction that can still commit (as
        ``contrib.django.enqueue`` checks), unless ALLOW_AUTOCOMMIT."""
        connection = connections[self.database]
        if connection.get_autocommit() and not self.allow_autocommit:
            raise NotInTransaction(
                f"{task.module_path}.enqueue() on database {self.database!r} outside a "
                "transaction would commit its outbox row on its own, apart from your business "
                "change: call it inside `with transaction.atomic():` (from async code, inside "
                "a function run with sync_to_async), or set "
                f"TASKS[{self.alias!r}]['OPTIONS']['ALLOW_AUTOCOMMIT'] = True if that is what "
                "you want"
            )
        connection.validate_no_broken_transaction()  # Django would refuse any query here
        return connection

    # -- results -------------------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult[Any]:
        raise ResultsNotKept(
            f"task result {result_id!r}: {BACKEND} keeps no results (the outbox keeps the "
            "call, its row, until it is delivered, not what the task returned), so results "
            "cannot be got or refreshed: store the outcome where the task can write it (a "
            "model, a cache)"
        )

    async def aget_result(self, result_id: str) -> TaskResult[Any]:
        return self.get_result(result_id)

    # -- system checks -------------------------------------------------------------------------

    def check(self, **kwargs: Any) -> Iterable[CheckMessage]:
        """Each queue is a declared family and the database is the Dispatcher's. Serves the
        Dispatcher too: Celery's Django fixup runs the checks as a worker starts, so that
        worker runs the rows of Django tasks."""
        try:
            dispatcher = get_dispatcher()
        except ImproperlyConfigured as exc:
            if apps.is_installed(APP):
                return []  # the app's own check (outbox_dispatch.E001) says why
            return [
                CheckError(
                    f"TASKS[{self.alias!r}] uses {BACKEND}, which writes through the "
                    f"Dispatcher of settings.{SETTING}: {exc}",
                    id="outbox_dispatch.E101",
                )
            ]
        serve(dispatcher)
        messages: list[CheckMessage] = []
        for queue in sorted(self.queues):
            try:
                self.family_for(queue, dispatcher, f"a task of TASKS[{self.alias!r}]")
            except TaskRefused as exc:
                messages.append(CheckError(str(exc), id="outbox_dispatch.E102"))
        # imported here: importing it registers the app's checks, which are not ours to add
        from outbox_dispatch.contrib.django.checks import database_problems

        databases = getattr(settings, "DATABASES", {})
        return messages + database_problems(databases, self.database, dispatcher.database_url)


# -- the run side ------------------------------------------------------------------------------


def serve(dispatcher: Dispatcher) -> None:
    """Let ``dispatcher``'s workers run the rows of Django tasks (found by their command, the
    task's module path). Idempotent."""
    dispatcher.registry.add_resolver(resolve_task)


def resolve_task(command: str) -> Registration | None:
    """The registration of a command that is a Django task's module path: its handler runs
    the task. None for any other command."""
    task = find_task(command)
    if task is None:
        return None
    family = task.queue_name  # informative only: each row carries its own family
    if family == DEFAULT_TASK_QUEUE_NAME:
        # (suppressed: the task's backend alias is gone from this process's TASKS)
        with contextlib.suppress(ImproperlyConfigured):
            family = getattr(task.get_backend(), "default_family", None) or family
    return Registration(command, family, partial(run_task, task), task=True)


def find_task(path: str) -> Task[Any, Any] | None:
    """The Task at a module path (``shop.tasks.send_receipt``): the ``@task`` object there, or
    the Task made of the function there (``send = task(send_receipt)``)."""
    module_name, _, name = path.rpartition(".")
    if not module_name or not name.isidentifier():
        return None
    module = _module(module_name, path)
    found = getattr(module, name, None) if module is not None else None
    if isinstance(found, Task):
        return found if found.module_path == path else None
    if callable(found):
        for value in vars(module).values():
            if isinstance(value, Task) and value.func is found:
                return value
    return None


def _module(name: str, path: str) -> ModuleType | None:
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            return None  # no such module: the command is no task's path
        failure: Exception = exc
    except Exception as exc:  # the module is there and fails to import
        failure = exc
    event(
        log,
        logging.WARNING,
        "task_import_failed",
        f"rows of {path!r} cannot run here: importing {name} failed: {failure!r}",
    )
    return None


def result_id(database: str, row_id: int) -> str:
    """A row's TaskResult id: ``outbox:<row id>``, with the database named unless it is
    ``default`` (a Dispatcher of one database), since row ids are per database."""
    return f"outbox:{row_id}" if database == DEFAULT_DB_ALIAS else f"outbox:{database}:{row_id}"


def run_task(task: Task[Any, Any], ctx: Context, payload: Any) -> None:
    """One attempt of a row: the task called with the row's args and kwargs (and a
    ``TaskContext`` when it takes one, whose ``attempt`` is the row's), between the
    framework's started and finished signals. An exception fails the attempt: the row is
    retried or parked by its family's policy."""
    if not (
        isinstance(payload, dict)
        and isinstance(payload.get("args"), list)
        and isinstance(payload.get("kwargs"), dict)
    ):
        raise PermanentFailure(
            f"row {ctx.row_id} is not a call of {task.module_path}: its payload is not "
            '{"args": [...], "kwargs": {...}}'
        )
    args, kwargs = payload["args"], payload["kwargs"]
    now = timezone.now()
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=result_id(ctx.database, ctx.row_id),
        status=TaskResultStatus("RUNNING"),
        enqueued_at=None,
        started_at=now,
        finished_at=None,
        last_attempted_at=now,
        args=args,
        kwargs=kwargs,
        backend=task.backend,
        errors=[],
        # one per attempt, as the framework counts them (TaskContext.attempt)
        worker_ids=[*(["earlier"] * (ctx.attempt - 1)), f"{socket.gethostname()}:{os.getpid()}"],
    )
    signals.task_started.send(OutboxBackend, task_result=result)
    try:
        if task.takes_context:
            task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            task.call(*args, **kwargs)
    except Exception as exc:
        error = TaskError(
            exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback="".join(traceback.format_exception(exc)),
        )
        failed = replace(
            result, status=TaskResultStatus("FAILED"), finished_at=timezone.now(), errors=[error]
        )
        signals.task_finished.send(OutboxBackend, task_result=failed)
        raise
    done = replace(result, status=TaskResultStatus("SUCCESSFUL"), finished_at=timezone.now())
    signals.task_finished.send(OutboxBackend, task_result=done)


def _aware(run_after: datetime | None) -> datetime | None:
    """``run_after`` as the row's due time; a naive one (``USE_TZ = False``, the framework
    refuses it otherwise) is in ``TIME_ZONE``, as Django reads naive datetimes."""
    if run_after is None or timezone.is_aware(run_after):
        return run_after
    aware: datetime = timezone.make_aware(run_after)
    return aware
