"""The base of the store: its pool, its connections (the one that starts work behind the
breaker), and the transaction and error helpers every concern's queries use. Driver errors
are translated here, once, into the outbox error tree."""

from __future__ import annotations

import contextlib
import select
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from outbox_dispatch.core.errors import (
    DatabaseError,
    DatabaseUnavailable,
    NoConnection,
    SchemaNotReady,
    StatementCancelled,
)
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.health import (
    PROBE_CONNECT_TIMEOUT,
    Breaker,
    Outage,
    liveness_options,
)
from outbox_dispatch.store.pool import Conn, ProcessPool
from outbox_dispatch.store.sqlfiles import queries_for


@contextmanager
def pipelined_transaction(conn: Conn) -> Iterator[None]:
    """A transaction in one pipeline, ``BEGIN`` and ``COMMIT`` sent as its statements: one
    round trip where nothing in the block fetches. psycopg's own transaction block syncs the
    pipeline at its end, a second round trip. The connection is in autocommit (pool.py);
    ``BEGIN`` names its isolation level, as psycopg's would (a claim must read committed,
    whatever the server's default); a block that fails is rolled back, so the pool gets it back
    idle."""
    level = conn.isolation_level
    begin = "BEGIN" if level is None else f"BEGIN ISOLATION LEVEL {level.name.replace('_', ' ')}"
    try:
        with conn.pipeline() as pipeline:
            conn.execute(begin)
            yield
            conn.execute("COMMIT")
            pipeline.sync()
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        raise


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Turn driver errors into ours, keeping the cause for the traceback."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaNotReady(
            f"{action}: outbox table not found ({mask_dsn(str(exc.diag.message_primary))}): "
            "run `outbox-dispatch migrate`"
        ) from exc
    except psycopg.errors.UndefinedFunction as exc:  # a schema migrated by an older version
        raise SchemaNotReady(
            f"{action}: the outbox schema is behind this version "
            f"({mask_dsn(str(exc.diag.message_primary))}): run `outbox-dispatch migrate`"
        ) from exc
    except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
        raise StatementCancelled(
            f"{action}: cancelled by the server ({mask_dsn(str(exc.diag.message_primary))}): "
            "its statement_timeout or lock_timeout (or a pg_cancel_backend) ends the outbox's "
            "statements too; raise them for the outbox's role if this repeats"
        ) from exc
    except PoolTimeout as exc:
        raise NoConnection(
            f"{action}: no database connection in time ({exc}): the database is not "
            "answering, or refuses more sessions (max_connections, the role's connection "
            "limit: raise it, or run fewer worker processes or a smaller pool_size), or this "
            "process's pool is busy"
        ) from exc
    except psycopg.OperationalError as exc:
        if not unreachable(exc):
            raise DatabaseError(f"{action} failed: {mask_dsn(str(exc))}") from exc
        why = mask_dsn(str(exc).strip().splitlines()[0] if str(exc) else repr(exc))
        raise DatabaseUnavailable(
            f"{action}: the database is not answering ({why}); its rows wait until it is back"
        ) from exc
    except psycopg.errors.ReadOnlySqlTransaction as exc:  # a standby, or a read-only default
        raise DatabaseError(
            f"{action} failed: the database refuses writes "
            f"({mask_dsn(str(exc.diag.message_primary))}): point the outbox at the primary, "
            "with a role whose default_transaction_read_only is off"
        ) from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"{action} failed: {mask_dsn(str(exc))}") from exc


def unreachable(exc: BaseException) -> bool:
    """Whether a driver error says the server is gone or going (a restart, a crash, an ended
    session, no connection in time) rather than refusing the statement itself."""
    if isinstance(exc, PoolTimeout):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


def hung_up(conn: Conn) -> bool:
    """Whether the server ended this idle pooled connection (a restart, pg_terminate_backend):
    its socket then holds the server's goodbye, or its end. Our pool's sessions listen to
    nothing, so an idle one has nothing else to read. A poll, not a round trip."""
    if conn.closed or conn.broken:
        return True
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)


def wake_channel(schema: str) -> str:
    """The NOTIFY channel of a schema (LISTEN quotes it, so its case is kept)."""
    return f"outbox_{schema}"[:63]  # Postgres channel names are identifiers: 63 bytes


class StoreBase:
    """The store's pool and connections for one schema (pool.py); each concern's queries are a
    mixin of it, and ``Store`` is them all."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *,
        pool_size: int = 4,
        handler_pool_size: int = 32,
        name: str = "default",
        breaker: Breaker | None = None,
        flushed_starts: bool = False,
    ) -> None:
        self.database_url = database_url
        self.flushed_starts = flushed_starts  # every start waits for its flush (core/policy.py)
        self.name = name  # the dispatcher's name for this database
        self.breaker = breaker
        self.schema = schema
        self.outage = Outage(name)
        self._clock_offset = 0.0
        self.q = queries_for(schema)
        self.channel = wake_channel(schema)
        self.pool = ProcessPool(
            database_url,
            schema,
            pool_size=pool_size,
            handler_pool_size=handler_pool_size,
            options=liveness_options(database_url) if breaker is not None else None,
        )

    @property
    def clock_offset(self) -> float:
        """Seconds added to the database clock in every query (tests: leases run out without
        sleeping). Always 0 outside tests."""
        return self._clock_offset

    @clock_offset.setter
    def clock_offset(self, seconds: float) -> None:
        self._clock_offset = float(seconds)
        self.q = queries_for(self.schema, self._clock_offset)

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Conn]:
        """A connection of the process's pool, waiting at most ``timeout`` seconds for one
        (None: the pool's own 30 s), given back when the block ends."""
        pool = self.pool.get()
        conn = self.live(pool, timeout)
        try:
            with conn:
                yield conn
        finally:
            pool.putconn(conn)
        self.outage.answered()

    def live(self, pool: ConnectionPool, timeout: float | None = None) -> Conn:
        """A pooled connection the server has not ended. The first one found ended (Postgres
        restarted, or an operator ended our sessions) says so once and has the pool test every
        idle one, so each stale connection costs no statement its failure."""
        conn = pool.getconn(timeout)
        if not hung_up(conn):
            return conn
        conn.close()
        pool.putconn(conn)  # closed: the pool drops it and opens another
        self.outage.failed("a pooled connection", "the server ended it")
        pool.check()
        return pool.getconn(timeout)

    @contextmanager
    def _starting(self, timeout: float | None = None) -> Iterator[Conn]:
        """A connection for anything but finishing work already running (a claim, a delivery
        start, a claim request, status and maintenance reads), waiting at most ``timeout``
        seconds for one (None: the pool's 30 s). With a breaker (several databases,
        health.py), the breaker sets the wait instead: it fails at once while this database
        is down, and a failure to reach it opens the breaker; a pool that is merely busy is
        waited for, as without one."""
        if self.breaker is None:
            with self.connection(timeout) as conn:
                yield conn
            return
        admission = self.breaker.admit()
        pool = self.pool.get()
        try:
            conn = self.live(pool, timeout=admission.timeout)
        except PoolTimeout as exc:
            why = "no connection from the pool in time"
            if admission.probe or not self._answers():
                self.breaker.failed(admission, why)
                raise DatabaseUnavailable(
                    f"database {self.breaker.name!r}: {why}; its rows wait until it is back, "
                    "the other databases go on"
                ) from exc
            try:
                conn = self.live(pool)  # it answers: the pool is busy, wait as without a breaker
            except BaseException:
                self.breaker.abandoned(admission)
                raise
        try:
            with conn:
                yield conn
        except psycopg.OperationalError as exc:
            if conn.broken or conn.closed:
                why = mask_dsn(str(exc).strip().splitlines()[0] if str(exc) else repr(exc))
                self.breaker.failed(admission, why)
                raise DatabaseUnavailable(
                    f"database {self.breaker.name!r} stopped answering ({why}); its rows wait "
                    "until it is back, the other databases go on"
                ) from exc
            self.breaker.succeeded(admission)  # it answered: the error is the work's own
            raise
        except BaseException:
            self.breaker.abandoned(admission)
            raise
        else:
            self.breaker.succeeded(admission)
        finally:
            pool.putconn(conn)

    def _answers(self) -> bool:
        """Whether a connection of its own reaches the database now (the pool had none to
        give in time: busy, or the database is down)."""
        try:
            psycopg.connect(self.database_url, connect_timeout=PROBE_CONNECT_TIMEOUT).close()
        except psycopg.Error:
            return False
        return True

    def close(self) -> None:
        self.pool.close()
