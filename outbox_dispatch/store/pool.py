"""The connection pool of a process, opened lazily and rebuilt after a fork: Celery's prefork
children must not share their parent's sockets. One per process and database: claims, starts,
heartbeats and settles (short statements) and transactional handlers' transactions take their
connections from it, so a delivery needs one session, the one its start used. Its size is
``pool_size`` plus ``handler_pool_size``: room for the handlers' transactions on top of the short
statements, so long handlers do not starve heartbeats."""

from __future__ import annotations

import logging
import os
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import MaskDsnFilter
from outbox_dispatch.store.sqlfiles import raw_queries

Conn = psycopg.Connection[Any]


class _Reconnects(logging.Filter):
    """psycopg_pool and psycopg warn once per connection they drop or fail to open, several
    times a second while Postgres restarts; the store says an outage once (health.Outage), so
    these lines are INFO. A dropped connection's line does not name its pool: another pool's
    is INFO too. A pool that gives up reconnecting still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and _reconnect_noise(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _reconnect_noise(message: str) -> bool:
    return message.startswith(
        (
            "error connecting in 'outbox-",
            "discarding closed connection",
            "discarding broken connection",
            "error ignored terminating <psycopg.Pipeline",
        )
    )


_POOL_FILTERS = (MaskDsnFilter(), _Reconnects())


def _mask_pool_logs() -> None:
    """psycopg_pool logs connection failures with the driver's message, which can quote the
    URL (and its password) it could not parse."""
    for name in ("psycopg.pool", "psycopg"):
        logger = logging.getLogger(name)
        for f in _POOL_FILTERS:
            if f not in logger.filters:
                logger.addFilter(f)


def _session(conn: Conn) -> None:
    """Every session of our pool, whatever the server's, role's, URL's or pooler's defaults
    (sql/session.sql's session_defaults):

    - READ COMMITTED, for transaction blocks and for lone statements alike: a claim counts
      what is in flight after it holds the family lock, so its statements need snapshots
      taken after the lock, not at the transaction's first statement (under REPEATABLE READ
      it would lease past max_in_flight, or fail to serialize); a lone UPDATE (a start, a
      settle) must not fail on a row another session changed meanwhile; and a
      transactional handler's settle must serialize with the heartbeat's renewal of its row,
      made from another connection while the handler runs.
    - Dates and intervals in the formats psycopg parses (DateStyle ISO, IntervalStyle
      postgres): a capped claim reads its candidates' due times.
    - No ``idle_session_timeout``: a pooled connection waits idle between statements."""
    q = raw_queries()
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED  # psycopg's BEGIN says so
    conn.execute(q["session_defaults"])


class ProcessPool:
    """The pool of the current process (the parent's is dropped, unclosed, after a fork)."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *,
        pool_size: int = 4,
        handler_pool_size: int = 32,
        options: dict[str, str] | None = None,
    ) -> None:
        self.database_url = database_url
        self.schema = schema
        self.options = options or {}  # libpq settings of its connections
        self.max_size = pool_size + handler_pool_size
        self._pool: ConnectionPool | None = None
        self._pid = 0
        self._lock = ForkSafeLock()
        # the sessions' synchronous_commit differs from the default of the URL, role and
        # server (their default flushes nothing): a transactional handler's transaction sets
        # that default back for itself (store/deliveries.py)
        self.flush_forced = False

    def _configure(self, conn: Conn) -> None:
        """The pool's sessions: as every session of ours (``_session``), and commits that wait
        for the disk, locally where the default is ``synchronous_commit=off``: a retry, park,
        cancel or ordered settle lost in a crash of Postgres would run its row again. The
        writes that need not wait say so per transaction: settle_without_flush, and the claim
        or the start, whichever does not flush (docs/guarantees.md); a transactional handler's
        transaction commits as the user's settings say (``flush_forced``). Every session of
        the pool has the same URL, role and server, so the same default."""
        q = raw_queries()
        _session(conn)
        if conn.execute(q["session_commits_flush"]).fetchone() is not None:
            self.flush_forced = True

    def get(self) -> ConnectionPool:
        pool = self._pool if self._pid == os.getpid() else None
        if pool is not None:
            return pool
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's pool is not ours
                self._pool = None
                self._pid = os.getpid()
            if self._pool is None:
                _mask_pool_logs()
                self._pool = ConnectionPool(
                    self.database_url,
                    min_size=1,
                    max_size=self.max_size,
                    kwargs={"autocommit": True, **self.options},
                    configure=self._configure,
                    open=True,
                    name=f"outbox-{self.schema}",
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid() and self._pool is not None:
                self._pool.close()
            self._pool = None
