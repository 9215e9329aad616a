"""Existing Celery tasks through the outbox, after one line: ``Celery("proj",
task_cls=OutboxTask)`` for every task of the app, or ``@app.task(base=OutboxTask)`` for one.

A call (``.delay()``, ``.apply_async()``) writes an outbox row in the caller's transaction
instead of publishing; the row's delivery runs the task's own function with its args and
kwargs, as the task's request would show them (``self.request.retries`` is the attempt,
``self.retry()`` and ``autoretry_for`` retry the row). task_options.py decides what a call's
options mean; this module does the writing and the running.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery import Task, current_task
from celery.exceptions import Retry

from outbox_dispatch.celery.task_options import TaskCall, plan_call
from outbox_dispatch.celery.transactions import (
    bound,
    bound_async,
    bound_database,
    django_transaction,
    sqlalchemy_transaction,
    wake_on_commit,
    warn_outside,
)
from outbox_dispatch.core.errors import (
    ConfigurationError,
    InvalidArgument,
    OutsideTransaction,
    ResultsNotSupported,
    UnknownFamily,
)
from outbox_dispatch.observe import tracing
from outbox_dispatch.store.async_callers import async_caller
from outbox_dispatch.store.callers import Steps, sync_caller

if TYPE_CHECKING:
    from outbox_dispatch.core.validation import PreparedRow
    from outbox_dispatch.databases import Database
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

# What a task call does when it finds no transaction (OutboxTask.outbox_outside).
COMMIT, RAISE, CELERY = "commit", "raise", "celery"
OUTSIDE = (COMMIT, RAISE, CELERY)

_FAMILY_NAME = re.compile(r"[a-z][a-z0-9_]{0,47}\Z")
INTERNAL = ("celery.", "outbox.")  # Celery's own tasks and ours never go through the outbox


class OutboxTask(Task):  # type: ignore[misc]
    """A Celery task whose calls go through the outbox. Class attributes (or the same names
    as ``@app.task(...)`` options) tune it:

    ``outbox = False`` opts a task out: plain Celery. ``outbox_family`` names its family
    (else the call's ``queue=``, the task's queue or route, else the dispatcher's
    ``task_family``). ``outbox_outside``: a call outside any transaction ``"commit"``\\s its
    row on its own (as a plain call is published at once), ``"raise"``\\s OutsideTransaction,
    or goes through plain ``"celery"``; unset (and the Dispatcher's ``task_outside`` unset),
    it commits on its own and logs a warning once per call site.
    """

    outbox: bool = True
    outbox_family: str | None = None
    outbox_outside: str | None = None

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        def plain() -> Any:
            return super(OutboxTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )

        if (
            not self.outbox
            or self.name.startswith(INTERNAL)
            or self.app.conf.task_always_eager
            or "retries" in options  # Celery's own retry of a call that ran as plain Celery
        ):
            return plain()  # opted out, eager (a shop's unit tests run the task inline), a retry
        dispatcher = _dispatcher_of(self)
        outside = self.outbox_outside or dispatcher.settings.task_outside
        try:
            conn = _transaction(dispatcher)
        except OutsideTransaction:
            if outside == CELERY:
                return plain()  # asked for: a call no outbox transaction can carry is Celery's
            raise
        if conn is None and outside == CELERY:
            return plain()
        if conn is None and outside is None and not _from_beat(options) and not current_task:
            warn_outside(self.name)  # then committed on its own, as "commit" does
        if conn is None and outside == RAISE and not _from_beat(options):  # beat has none
            raise OutsideTransaction(
                f"{self.name} was called outside a transaction, and its outbox_outside is "
                "'raise': call it inside `transaction.atomic()` (Django) or `with "
                "outbox_dispatch.using(conn):` around an open transaction"
            )
        if self.typing and hasattr(self, "__header__"):
            self.__header__(*(args or ()), **(kwargs or {}))  # a wrong call fails here, as Celery's
        if getattr(self, "_dump_pydantic_arguments", None) is not None:
            args, kwargs = self._dump_pydantic_arguments(args, kwargs)  # pydantic=True tasks
        given = {"task_id": task_id, "link": link, "link_error": link_error, **options}
        call = plan_call(
            self.name,
            args,
            kwargs,
            {k: v for k, v in given.items() if v is not None},
            now=datetime.now(UTC),
            tz=self.app.timezone,
        )
        family = task_family(dispatcher, self, call, args, kwargs)
        row_id = write_call(dispatcher, conn, self.name, call, family, bound_database())
        return EnqueuedTask(call.task_id or f"outbox:{row_id}", row_id, self.name)

    async def aapply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> EnqueuedTask:
        """``apply_async`` in async code: the row is written, awaited, on the connection of
        the enclosing ``async with outbox_dispatch.using(conn):``, in its transaction."""
        conn = bound()
        if conn is None or not bound_async():
            raise OutsideTransaction(
                f"{self.name}.aapply_async() writes on the connection of `async with "
                "outbox_dispatch.using(conn):` around an open transaction; there is none here"
            )
        dispatcher = _dispatcher_of(self)
        given = {"task_id": task_id, **options}
        call = plan_call(
            self.name,
            args,
            kwargs,
            {k: v for k, v in given.items() if v is not None},
            now=datetime.now(UTC),
            tz=self.app.timezone,
        )
        family = task_family(dispatcher, self, call, args, kwargs)
        d = dispatcher
        row = _row_of(d, self.name, call, family)
        caller = await async_caller(conn)
        db = await d.writer.adatabase(caller, bound_database())
        row_id = await caller.drive(_call_steps(d, db, row, self.name, call), "enqueue")
        return EnqueuedTask(call.task_id or f"outbox:{row_id}", row_id, self.name)

    async def adelay(self, *args: Any, **kwargs: Any) -> EnqueuedTask:
        """``delay`` in async code, as ``aapply_async``."""
        return await self.aapply_async(args, kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry; during an outbox delivery, a Retry returned rather than raised
        (``throw=False``) is kept, so that the row is retried when the task returns, and an
        error raised because max_retries ran out is marked so, for the parked row's reason."""
        flags = getattr(self.request, "outbox_flags", None)
        try:
            ret = super().retry(*args, **kwargs)
        except Retry:
            raise
        except Exception:
            if flags is not None:
                flags["retries_out"] = True
            raise
        if flags is not None:
            flags["retry"] = ret
        return ret

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """A call of the task inside an outbox delivery (``run_task``) keeps the delivery's
        request (its id, retries, ``outbox``) under the call's own, as Celery >= 5.5 does;
        only that call shares the delivery's retry marks (a nested call of the task gets its
        own)."""
        outer = self.request_stack.top
        if not args and outer is not None and getattr(outer, "outbox", None) is not None:
            own = getattr(outer, "outbox_depth", None) == 0
            kwargs = {
                **outer.__dict__,
                "outbox_depth": 1 if own else 2,
                "outbox_flags": outer.outbox_flags if own else {},
                **kwargs,
            }
        super().push_request(*args, **kwargs)


def _transaction(dispatcher: Dispatcher) -> object | None:
    """The open transaction a call joins: the connection bound by ``using()`` (None when it
    is in no transaction: nothing to join), else Django's on the outbox's database, else
    SQLAlchemy's (watch_sqlalchemy)."""
    conn = bound()
    if conn is not None:
        if bound_async():
            raise InvalidArgument(
                "a task's .delay() or .apply_async() cannot write on the async connection of "
                "`async with using(conn)`: await task.adelay(...) or task.aapply_async(...)"
            )
        return conn if sync_caller(conn).joinable() else None
    django: object | None = django_transaction([db.url for db in dispatcher.databases.values()])
    if django is not None:
        return django
    found: object | None = sqlalchemy_transaction(
        [d.targets for d in dispatcher.databases.values()]
    )
    return found


def _from_beat(options: dict[str, Any]) -> bool:
    """A periodic task sent by Celery beat (which marks its calls so): never in a
    transaction, so its row is committed even where other calls must not be."""
    headers = options.get("headers")
    return isinstance(headers, dict) and bool(headers.get("celery_beat_task"))


def _dispatcher_of(task: Any) -> Dispatcher:
    dispatcher = getattr(task.app, "outbox_dispatcher", None)
    if dispatcher is None:
        raise ConfigurationError(
            f"{task.name} is an OutboxTask, but Celery app {task.app.main!r} has no Dispatcher: "
            "build outbox_dispatch.Dispatcher(app, ...) where the app is defined"
        )
    return dispatcher  # type: ignore[no-any-return]


def task_family(dispatcher: Dispatcher, task: Any, call: TaskCall, args: Any, kwargs: Any) -> str:
    """The family of a call: the call's ``queue=``, else the task's ``outbox_family``, its
    ``queue`` or its ``task_routes`` route; a queue names a family of that name, and the
    app's default queue the dispatcher's ``task_family``."""
    queue = call.queue
    if queue is None:
        if task.outbox_family:
            return _declared(dispatcher, task.name, task.outbox_family, "outbox_family")
        queue = getattr(task, "queue", None) or _routed(task, args, kwargs)
    prefix = dispatcher.settings.queue_prefix + "."
    if queue.startswith(prefix):
        queue = queue[len(prefix) :]
    if queue in dispatcher.families:
        return queue
    if queue == (task.app.conf.task_default_queue or "celery"):
        return _declared(dispatcher, task.name, dispatcher.settings.task_family, "task_family")
    if queue == "claim" or not _FAMILY_NAME.match(queue):
        raise UnknownFamily(
            f"{task.name} is routed to queue {queue!r}, which no outbox family can be (family "
            "names are 1-48 lower-case letters, digits or _, and the claim queue is the "
            "outbox's own): route it to a family's name, or set the task's outbox_family"
        )
    raise UnknownFamily(
        f"{task.name} is routed to queue {queue!r}, which is no outbox family: declare "
        f"dispatcher.family({queue!r}) (its workers consume {dispatcher.queue_name(queue)!r}), "
        "or set the task's outbox_family"
    )


def _routed(task: Any, args: Any, kwargs: Any) -> str:
    """The queue Celery's router picks for the task (``task_routes``, else the default)."""
    route = task.app.amqp.router.route({}, task.name, args, kwargs)
    queue = route.get("queue")
    name = getattr(queue, "name", queue)
    return str(name or task.app.conf.task_default_queue or "celery")


def _declared(dispatcher: Dispatcher, task: str, family: str, what: str) -> str:
    if family not in dispatcher.families:
        raise UnknownFamily(
            f"{task}'s {what} {family!r} is not declared: add dispatcher.family({family!r}) "
            "before the first call"
        )
    return family


class EnqueuedTask:
    """What a call through the outbox returns in place of an AsyncResult: the call's id (its
    ``task_id=``, else ``outbox:<row id>``; the task sees it as ``self.request.id``) and its
    row. There is no result to wait for: ``get()`` and the state raise at once."""

    def __init__(self, task_id: str, row_id: int, name: str) -> None:
        self.id = task_id
        self.task_id = task_id
        self.row_id = row_id
        self.name = name

    def __str__(self) -> str:
        return self.id

    def __repr__(self) -> str:
        return f"<EnqueuedTask {self.name}[{self.id}] row={self.row_id}>"

    def _refuse(self) -> ResultsNotSupported:
        return ResultsNotSupported(
            f"{self.name}[{self.id}] went through the outbox (row {self.row_id}), which keeps "
            "no task results: store the outcome where the task can write it, or opt the task "
            "out with outbox=False"
        )

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    wait = get

    def ready(self) -> bool:
        raise self._refuse()

    @property
    def state(self) -> str:
        raise self._refuse()

    status = state

    @property
    def result(self) -> Any:
        raise self._refuse()


def write_call(
    dispatcher: Dispatcher,
    conn: object,
    task: str,
    call: TaskCall,
    family: str,
    database: str | None = None,
) -> int:
    """The row of a task call on the caller's connection; with ``conn=None``, in a transaction
    of its own, committed before this returns (``task_outside="commit"``)."""
    d = dispatcher
    row = _row_of(d, task, call, family)
    due_now = call.delay is None and call.at is None
    if conn is not None:
        caller = sync_caller(conn)
        db = d.writer.database(caller, database)
        row_id = caller.drive(_call_steps(d, db, row, task, call), "enqueue")
        if due_now and type(conn).__module__.startswith("django."):
            wake_on_commit(conn, d, [family])  # only when nobody listens
        return row_id
    first = d.database()  # outside any transaction: the first database's outbox
    with first.store.connection() as own:
        row_id = sync_caller(own).drive(_call_steps(d, first, row, task, call), "enqueue")
    if not d.settings.listen and due_now:
        d.runtime.request_claim(family)  # committed: the NOTIFY wakes only a listener
    return row_id


def _row_of(d: Dispatcher, task: str, call: TaskCall, family: str) -> PreparedRow:
    """A task call's row, validated, with the caller's trace context."""
    fields = (task, call.payload, call.actor, call.dedupe_key, call.delay, call.at, family)
    return d.writer.row(*fields, trace_json=tracing.current_context_json())


def _call_steps(
    d: Dispatcher, db: Database, row: PreparedRow, task: str, call: TaskCall
) -> Steps[int]:
    """The row, and a refusal when its dedupe key is held by another command's row: that row
    would be handed to this call, and one task's call must never be taken for another's."""
    row_id = yield from d.writer.insert(db, row)
    if call.dedupe_key is not None:
        holder = yield from db.store.command_of(row_id)
        if holder is not None and holder != task:
            raise InvalidArgument(
                f"{task}: dedupe key {call.dedupe_key!r} is held by row {row_id} of "
                f"{holder!r}; give each task's calls keys of their own"
            )
    return row_id
