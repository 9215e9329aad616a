"""The caller's connection, whichever driver holds it. An outbox row is written on the
connection of the caller's own transaction, so that it commits or rolls back with the business
change: psycopg 3 and psycopg2 (raw, under Django or SQLAlchemy) in sync code here; psycopg 3's
AsyncConnection and asyncpg in async code in store/async_callers.py.

The statements themselves are written once (store/enqueue.py, as generators of ``Step``s);
a ``Caller`` runs them on one driver, an ``AsyncCaller`` awaits them on another."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from outbox_dispatch.core.errors import (
    DatabaseError,
    InvalidArgument,
    SchemaNotReady,
    StatementCancelled,
)
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.adapters import database_target

T = TypeVar("T")
Row = tuple[Any, ...]
Target = tuple[str, str, str]


@dataclass(frozen=True)
class One:
    """A statement whose first row (or None) is the answer."""

    sql: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class All:
    """A statement whose rows are the answer."""

    sql: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Exec:
    """A statement with no answer."""

    sql: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Each:
    """One statement run for each set of params; the answer is each run's first row (or
    None), in order."""

    sql: str
    params: Sequence[Mapping[str, Any]]


Step = One | All | Exec | Each
Steps = Generator[Step, Any, T]

USE = (
    "pass the connection of your open transaction: psycopg 3 or psycopg2 (a Connection, "
    "Django's connection, a SQLAlchemy Session or Connection) to enqueue, and psycopg 3's "
    "AsyncConnection or asyncpg's (or SQLAlchemy's AsyncSession or AsyncConnection) to aenqueue"
)


class Caller(ABC):
    """A sync driver's connection, as the outbox writes on it."""

    driver = ""

    def __init__(self, conn: Any, holder: object) -> None:
        self.conn = conn
        self.holder = holder  # what the caller passed (a Django connection has its alias)

    def drive(self, steps: Steps[T], action: str) -> T:
        """Run every statement of ``steps`` here, in the caller's transaction."""
        with driver_errors(action), self.scope():
            answer: Any = None
            try:
                while True:
                    answer = self.run(steps.send(answer))
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    @abstractmethod
    def run(self, step: Step) -> Any:
        """One statement on this driver, with its answer."""

    @abstractmethod
    def joinable(self) -> bool:
        """Whether a row written here commits with a transaction of the caller's: one is open
        (whatever the autocommit flag says), or the driver opens one that the caller commits."""

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Statements that belong together: on a connection in a transaction (the caller's)
        they run in it; on one in autocommit and outside any, in a transaction of their own."""
        yield

    @abstractmethod
    def target(self) -> Target | None:
        """Where the connection goes (host, port, database)."""


class Psycopg(Caller):
    driver = "psycopg"

    def joinable(self) -> bool:
        from psycopg.pq import TransactionStatus

        idle = self.conn.info.transaction_status == TransactionStatus.IDLE
        return not (self.conn.autocommit and idle)

    def run(self, step: Step) -> Any:
        if isinstance(step, Each):
            rows: list[Row | None] = []
            with self.conn.cursor() as cur:
                cur.executemany(step.sql, step.params, returning=True)
                for _ in step.params:
                    rows.append(cur.fetchone())
                    cur.nextset()
            return rows
        cursor = self.conn.execute(step.sql, step.params)
        if isinstance(step, Exec):
            return None
        return cursor.fetchone() if isinstance(step, One) else cursor.fetchall()

    @contextmanager
    def scope(self) -> Iterator[None]:
        from psycopg.pq import TransactionStatus

        status = self.conn.info.transaction_status
        if status == TransactionStatus.INERROR:
            raise InvalidArgument(failed(self.driver))
        if self.conn.autocommit and status == TransactionStatus.IDLE:
            with self.conn.transaction():
                yield
        else:
            yield

    def target(self) -> Target | None:
        info = self.conn.info
        return database_target({"host": info.host, "port": info.port, "dbname": info.dbname})


class Psycopg2(Caller):
    driver = "psycopg2"

    def joinable(self) -> bool:
        import psycopg2.extensions as ext

        idle = self.conn.get_transaction_status() == ext.TRANSACTION_STATUS_IDLE
        return not (self.conn.autocommit and idle)

    def run(self, step: Step) -> Any:
        with self.conn.cursor() as cur:
            if isinstance(step, Each):
                rows: list[Row | None] = []
                for params in step.params:
                    cur.execute(step.sql, params)
                    rows.append(cur.fetchone())
                return rows
            cur.execute(step.sql, step.params)
            if isinstance(step, Exec):
                return None
            return cur.fetchone() if isinstance(step, One) else cur.fetchall()

    @contextmanager
    def scope(self) -> Iterator[None]:
        import psycopg2.extensions as ext

        status = self.conn.get_transaction_status()
        if status == ext.TRANSACTION_STATUS_INERROR:
            raise InvalidArgument(failed(self.driver))
        if not (self.conn.autocommit and status == ext.TRANSACTION_STATUS_IDLE):
            yield
            return
        with self.conn.cursor() as cur:
            cur.execute("BEGIN")
            try:
                yield
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def target(self) -> Target | None:
        info = self.conn.info
        return database_target({"host": info.host, "port": info.port, "dbname": info.dbname})


def sync_caller(conn: object) -> Caller:
    """The caller's connection for ``enqueue``, ``enqueue_many``, ``cancel`` and task calls."""
    raw, holder = _unwrap_sync(conn), conn
    module = type(raw).__module__
    if module.startswith("psycopg2"):
        caller: Caller = Psycopg2(raw, holder)
        closed = bool(raw.closed)
    elif module.startswith("psycopg") and hasattr(raw, "pgconn"):
        if type(raw).__name__.startswith("Async"):
            raise InvalidArgument(
                f"{type(conn).__name__} is an async connection: await dispatcher.aenqueue(...) "
                "(or aenqueue_many, acancel) on it"
            )
        caller = Psycopg(raw, holder)
        closed = bool(raw.closed)
    else:
        raise InvalidArgument(unusable(conn))
    if closed:
        raise InvalidArgument(f"the {caller.driver} connection passed is closed: {USE}")
    return caller


def _unwrap_sync(conn: Any) -> Any:
    """The driver connection inside Django's connection or a SQLAlchemy Session/Connection."""
    module = type(conn).__module__
    if module.startswith("sqlalchemy"):
        from sqlalchemy.engine import Connection
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        from sqlalchemy.orm import Session

        if isinstance(conn, AsyncSession | AsyncConnection):
            raise InvalidArgument(
                f"{type(conn).__name__} is async: await dispatcher.aenqueue(...) with it"
            )
        if isinstance(conn, Session):
            conn = conn.connection()  # begins the session's transaction if it has none
        if isinstance(conn, Connection):
            return conn.connection.driver_connection
        raise InvalidArgument(unusable(conn))
    if module.startswith("django.") or (
        hasattr(conn, "vendor") and hasattr(conn, "ensure_connection")  # a custom backend
    ):
        if getattr(conn, "vendor", None) != "postgresql":
            raise InvalidArgument(
                f"Django database {getattr(conn, 'alias', '?')!r} is "
                f"{getattr(conn, 'vendor', '?')}: the outbox lives in PostgreSQL"
            )
        conn.ensure_connection()
        return conn.connection
    return conn


def unusable(conn: object) -> str:
    return f"the outbox cannot write through a {type(conn).__module__}.{type(conn).__name__}: {USE}"


def failed(driver: str) -> str:
    return (
        f"the {driver} connection's transaction failed earlier and can only be rolled back: "
        "roll it back, then enqueue in a new transaction"
    )


# SQLSTATEs the outbox explains: a schema not migrated, a statement the server cancelled, a
# database that refuses writes
_UNDEFINED = {"42P01", "42883"}
_CANCELLED = {"57014", "55P03"}
_READ_ONLY = "25006"


@contextmanager
def driver_errors(action: str) -> Iterator[None]:
    """Turn any driver's errors into ours, keeping the cause for the traceback."""
    try:
        yield
    except Exception as exc:
        state = _sqlstate(exc)
        if state is None and not _is_driver_error(exc):
            raise
        text = mask_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        if state in _UNDEFINED:
            raise SchemaNotReady(
                f"{action}: the outbox schema is missing or behind this version ({text}): "
                "run `outbox-dispatch migrate`"
            ) from exc
        if state in _CANCELLED:
            raise StatementCancelled(
                f"{action}: cancelled by the server ({text}): its statement_timeout or "
                "lock_timeout ends the outbox's statements too"
            ) from exc
        if state == _READ_ONLY:
            raise DatabaseError(
                f"{action} failed: the database refuses writes ({text}): point the outbox "
                "at the primary"
            ) from exc
        raise DatabaseError(f"{action} failed: {text}") from exc


def _sqlstate(exc: BaseException) -> str | None:
    for name in ("sqlstate", "pgcode"):
        value = getattr(exc, name, None)
        if isinstance(value, str) and len(value) == 5:
            return value
    return None


def _is_driver_error(exc: BaseException) -> bool:
    for module, name in (("psycopg", "Error"), ("psycopg2", "Error"), ("asyncpg", "PostgresError")):
        found = sys.modules.get(module)
        base = getattr(found, name, None) if found is not None else None
        if isinstance(base, type) and isinstance(exc, base):
            return True
    interface = getattr(sys.modules.get("asyncpg"), "InterfaceError", None)
    return isinstance(interface, type) and isinstance(exc, interface)
