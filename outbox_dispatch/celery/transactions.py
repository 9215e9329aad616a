"""Which transaction a Celery task call belongs to, so that ``task.delay()`` writes its outbox
row there: the connection bound with ``outbox_dispatch.using(conn)`` (psycopg, SQLAlchemy),
else Django's connection to the outbox's database while it is in a transaction
(``transaction.atomic()`` on any alias). Nothing here opens a connection.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from outbox_dispatch.core.errors import OutsideTransaction
from outbox_dispatch.core.logs import event
from outbox_dispatch.store.adapters import database_target, django_target
from outbox_dispatch.store.async_callers import async_caller
from outbox_dispatch.store.callers import Target, sync_caller

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

_bound: ContextVar[tuple[object, str | None, bool] | None] = ContextVar(
    "outbox_dispatch_using", default=None
)
# SQLAlchemy connections of this context in a transaction, innermost last (watch_sqlalchemy)
_sqlalchemy: ContextVar[tuple[Any, ...]] = ContextVar("outbox_dispatch_sqlalchemy", default=())
_watching: list[bool] = []
_warned: set[tuple[str, int]] = set()


class using:
    """Task calls inside this block write their rows on ``conn``, so they commit or roll back
    with the caller's transaction. ``with using(conn):`` for ``.delay()`` and
    ``.apply_async()`` on a psycopg 3 or psycopg2 connection, a SQLAlchemy Session or
    Connection, or a Django connection; ``async with using(conn):`` for ``await
    task.adelay()`` and ``await task.aapply_async()`` on psycopg 3's AsyncConnection, asyncpg's,
    or SQLAlchemy's AsyncSession or AsyncConnection. ``database`` names which of the
    dispatcher's databases ``conn`` is, when a proxy hides it."""

    def __init__(self, conn: object, *, database: str | None = None) -> None:
        self.conn = conn
        self.database = database
        self._tokens: list[Any] = []

    def __enter__(self) -> None:
        sync_caller(self.conn)  # refuse what cannot carry a row now, not at the first call
        self._tokens.append(_bound.set((self.conn, self.database, False)))

    def __exit__(self, *exc: object) -> None:
        _bound.reset(self._tokens.pop())

    async def __aenter__(self) -> None:
        await async_caller(self.conn)  # the same refusal, for an async connection
        self._tokens.append(_bound.set((self.conn, self.database, True)))

    async def __aexit__(self, *exc: object) -> None:
        _bound.reset(self._tokens.pop())


def bound_async() -> bool:
    """Whether the innermost binding is ``async with using(conn)``."""
    found = _bound.get()
    return found is not None and found[2]


def bound() -> object | None:
    found = _bound.get()
    return None if found is None else found[0]


def bound_database() -> str | None:
    """The database named by the innermost ``using(..., database=)``, if any."""
    found = _bound.get()
    return None if found is None else found[1]


def django_transaction(database_urls: Sequence[str]) -> Any | None:
    """Django's connection (this thread's) to one of the outbox's databases when it is inside a
    transaction, else None. A transaction open only on another database cannot carry the
    row: that is refused, since writing the row apart from it would be a silent dual write."""
    if "django.db" not in sys.modules:
        return None
    from django.conf import settings

    if not settings.configured:
        return None
    from django.db import connections

    ours, others = [], []
    for conn in connections.all(initialized_only=True):
        in_transaction = conn.in_atomic_block or (
            conn.connection is not None and not conn.get_autocommit()
        )
        if not in_transaction:
            continue
        same = [same_database(conn.settings_dict, url) for url in database_urls]
        # a service file or a default decides (None): taken as ours, the enqueue will tell
        if conn.vendor == "postgresql" and (True in same or None in same):
            ours.append(conn)
        else:
            others.append(conn)
    if len(ours) > 1:
        names = ", ".join(repr(c.alias) for c in ours)
        raise OutsideTransaction(
            f"Django databases {names} are all in a transaction on an outbox database: "
            "say which one carries the task calls with `with outbox_dispatch.using("
            "connections[alias]):`"
        )
    if ours:
        # Django refuses queries in a transaction an error broke; the row bypasses its cursor
        ours[0].validate_no_broken_transaction()
        return ours[0]
    if others:
        names = ", ".join(repr(c.alias) for c in others)
        raise OutsideTransaction(
            f"this task call is inside a transaction on Django database {names}, which is "
            "not the outbox's database, so its row cannot commit with that transaction: "
            "keep the outbox in the same database as the data it follows, or call the task "
            "outside that block"
        )
    return None


def watch_sqlalchemy() -> None:
    """Follow SQLAlchemy's transactions (every Engine's begin, commit and rollback), so that a
    task call inside a Session's or Connection's transaction joins it without ``using``, as
    one inside Django's ``atomic()`` does. Nothing to do when SQLAlchemy is not installed."""
    if _watching or importlib.util.find_spec("sqlalchemy") is None:
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.listen(Engine, "begin", _began)
    event.listen(Engine, "commit", _ended)
    event.listen(Engine, "rollback", _ended)
    _watching.append(True)


def _began(conn: Any) -> None:
    _sqlalchemy.set((*_sqlalchemy.get(), conn))


def _ended(conn: Any) -> None:
    _sqlalchemy.set(tuple(c for c in _sqlalchemy.get() if c is not conn))


def sqlalchemy_transaction(targets: Sequence[frozenset[Target]]) -> Any | None:
    """The SQLAlchemy connection of this context in a transaction on one of the outbox's
    databases (``targets``: where each of them is), else None; two of them are ambiguous."""
    ours = []
    for conn in _sqlalchemy.get():
        if conn.closed or not conn.in_transaction():
            continue  # ended without an event we saw (a connection invalidated, a pool reset)
        url = conn.engine.url
        where = database_target({"host": url.host, "port": url.port, "dbname": url.database})
        if where is None or any(where in t for t in targets):
            ours.append(conn)
    if len(ours) > 1:
        raise OutsideTransaction(
            "this task call is inside several SQLAlchemy transactions on the outbox's "
            "database: say which one carries it with `with outbox_dispatch.using(session):`"
        )
    return ours[0] if ours else None


def warn_outside(task: str) -> None:
    """Say once per call site that a task call committed its row on its own, apart from any
    transaction: the dual write the outbox exists to remove, unless that is what was meant.
    (Calls made by a running task, as chains and follow-ups are, are not warned about.)"""
    site = _call_site()
    if site in _warned:
        return
    _warned.add(site)
    event(
        log,
        logging.WARNING,
        "task_outside_transaction",
        f"{task} was called at {site[0]}:{site[1]} outside any transaction the outbox can see, "
        "so its row committed on its own: wrap the call and your change in one transaction "
        "(`with outbox_dispatch.using(conn):`, Django's `transaction.atomic()`, a SQLAlchemy "
        "Session's transaction), or set task_outside='commit' (or the task's outbox_outside) "
        "if committing on its own is what you want",
    )


def _call_site() -> tuple[str, int]:
    """The first frame outside Celery, kombu and this package: the line that called the task."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(f"{os.sep}{p}{os.sep}" in name for p in ("celery", "kombu", "outbox_dispatch")):
            return name, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "?", 0


def same_database(settings_dict: dict[str, Any], database_url: str) -> bool | None:
    """Whether a Django DATABASES entry names the database of ``database_url``; None when
    either side leaves it to a service file or libpq's defaults."""
    from psycopg.conninfo import conninfo_to_dict

    ours = database_target(conninfo_to_dict(database_url))
    theirs = django_target(settings_dict)
    if ours is None or theirs is None:
        return None
    return theirs == ours


class _Wake:
    """An ``on_commit`` callback: one claim pass for one family. A class, so that the
    callbacks still pending in a transaction can be recognised."""

    def __init__(self, dispatcher: Dispatcher, family: str, database: str) -> None:
        self.dispatcher = dispatcher
        self.family = family
        self.database = database
        # Django names a failing robust callback by its __qualname__
        self.__qualname__ = f"outbox_dispatch wake of family {family!r}"

    def __call__(self) -> None:
        self.dispatcher.runtime.request_claim(self.family, self.database)


def wake_on_commit(connection: Any, dispatcher: Dispatcher, families: Iterable[str]) -> None:
    """After a Django transaction commits, ask for a claim of ``families`` (when no commit
    listener hears the insert's NOTIFY): Django's own ``on_commit``, no import of Django."""
    wanted = sorted(set(families))
    if not wanted or _listens(dispatcher):
        return
    if not connection.in_atomic_block and not connection.get_autocommit():
        return  # manual transaction management: Django has no on_commit here
    database = dispatcher.database_of(connection).name
    # Callbacks of a rolled-back savepoint leave run_on_commit, so a family whose wake was
    # discarded with it is registered again.
    pending = {
        entry[1].family
        for entry in connection.run_on_commit
        if isinstance(entry[1], _Wake) and entry[1].dispatcher is dispatcher
    }
    for family in wanted:
        if family not in pending:
            # in autocommit (allow_autocommit=True) on_commit runs the wake right away
            connection.on_commit(_Wake(dispatcher, family, database), robust=True)


def _listens(dispatcher: Dispatcher) -> bool:
    """Whether the dispatcher's workers run the NOTIFY listener (``Dispatcher(listen=True)``)."""
    return dispatcher.settings.listen
