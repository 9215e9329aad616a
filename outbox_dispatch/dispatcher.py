"""The public entry point: declare families and handlers, write outbox rows in the caller's
transaction, cancel them, drain in tests, migrate. Celery's side is ``runtime.py``, the
operator's calls ``operations.py``, the settings ``settings.py``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import Celery

from outbox_dispatch.caps.semaphore import Caps
from outbox_dispatch.celery import wiring
from outbox_dispatch.celery.transactions import watch_sqlalchemy
from outbox_dispatch.core import timings
from outbox_dispatch.core.errors import (
    ConfigurationError,
    UnknownDatabase,
)
from outbox_dispatch.core.handlers import HandlerFn, Registration, Registry
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.naming import command_name, family_name
from outbox_dispatch.core.policy import (
    Backoff,
    CapRule,
    Family,
    LostAttempt,
    builtin_families,
    cap_rule,
    family_is_capped,
    require_whole,
)
from outbox_dispatch.core.validation import Message, check_cancel
from outbox_dispatch.databases import Database
from outbox_dispatch.observe import metrics, tracing
from outbox_dispatch.operations import Operations
from outbox_dispatch.runtime import Runtime
from outbox_dispatch.settings import Settings, retention_seconds, seconds
from outbox_dispatch.store.callers import sync_caller
from outbox_dispatch.store.migrations import migrate
from outbox_dispatch.store.pool import Conn
from outbox_dispatch.worker.drain import DrainReport, drain
from outbox_dispatch.writing import Writer

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session as SASession

    # what enqueue and cancel accept: the connection (or session) of the caller's transaction
    TxConn = Conn | SAConnection | SASession


@dataclass(frozen=True)
class CancelResult:
    """Rows settled as cancelled at once, and running rows whose handler was asked to stop."""

    cancelled: list[int]
    requested: list[int]


class Dispatcher:
    """Wires the outbox into a Celery app: ``Dispatcher(app, database_url=..., redis_url=...)``
    with any other setting of ``Settings`` as a keyword, or ``Dispatcher(app, settings)``.
    Nothing connects until it is used, so building one at import time opens no sockets."""

    def __init__(self, app: Celery, settings: Settings | None = None, **options: Any) -> None:
        if settings is not None and options:
            raise ConfigurationError("pass Settings or keyword settings to Dispatcher(), not both")
        self.settings = s = settings if settings is not None else Settings.of(options)
        if getattr(app, "outbox_dispatcher", None) is not None:
            # Celery would hand back the first one's tasks: this one's rows would never run
            raise ConfigurationError(
                f"Celery app {app.main!r} already has a Dispatcher: build one per app (one "
                "Dispatcher serves several databases with databases={name: url})"
            )
        self.app = app
        self.schema = s.schema
        self.families: dict[str, Family] = builtin_families()
        self.registry = Registry(resolve=lambda command: self.runtime.task_registration(command))
        self.caps = Caps(s.redis_url, s.key_prefix) if s.redis_url else None
        app.outbox_dispatcher = self  # lets `--app proj:celery_app` find us, as celery -A does
        wiring.write_settings(app)
        self.runtime = Runtime(self)
        self.databases: dict[str, Database] = self.runtime.build_databases(self.caps)
        if self.caps is not None:
            self.caps.databases = [None if d.primary else d.name for d in self.databases.values()]
        first = self.database()  # its parts under the names a one-database dispatcher had
        self.database_url = first.url
        self.store, self.claimer, self.delivery = first.store, first.claimer, first.delivery
        # with commit listeners, the leading one claims every claim_interval itself and beat's
        # entry is the safety net (claim/listener.py)
        claim_every = s.claim_seconds
        beat_every = max(claim_every, timings.SAFETY_INTERVAL) if s.listen else claim_every
        wiring.add_beat_entry(app, beat_every, self.claim_queue)
        self.ops = Operations(self)
        self.writer = Writer(self)
        wiring.on_configured(app, self._apply_queues)
        if s.listen:
            wiring.install_listener_step(app, self.runtime.commit_listeners)
        metrics.install_worker_server(app, self)
        for db in self.databases.values():
            wiring.on_worker_exit(db.delivery.deferred.flush)
        wiring.on_pool_process_start(self.runtime.warm_up)
        watch_sqlalchemy()  # task calls in a SQLAlchemy transaction join it, as in Django's

    # -- databases -------------------------------------------------------------------------

    def database(self, name: str | None = None) -> Database:
        """The database called ``name`` (None: the first)."""
        if name is None:
            return next(iter(self.databases.values()))
        try:
            return self.databases[name]
        except KeyError:
            url = "://" in name or "=" in name  # `--database URL` for `--database-url URL`
            raise UnknownDatabase(
                f"no database {mask_dsn(name)!r}: this dispatcher has "
                f"{', '.join(map(repr, self.databases))}"
                + ("; a URL goes to --database-url" if url else "")
            ) from None

    @property
    def several(self) -> bool:
        """Whether this dispatcher serves more than one database."""
        return len(self.databases) > 1

    def shown(self, db: Database) -> str | None:
        """The database name log lines carry: none with one database."""
        return db.name if self.several else None

    def chosen_databases(self, name: str | None) -> list[Database]:
        """The one database named, or every database."""
        return list(self.databases.values()) if name is None else [self.database(name)]

    # -- declaration ----------------------------------------------------------------------

    @property
    def claim_queue(self) -> str:
        return f"{self.settings.queue_prefix}.claim"

    def queue_name(self, family: str) -> str:
        return f"{self.settings.queue_prefix}.{family}"

    def family(
        self,
        name: str,
        *,
        max_attempts: int | None = 10,
        backoff: Backoff | None = None,
        lease: float = 60.0,
        max_in_flight: int = 1000,
        per_actor: int | None = None,
        ordered: bool = False,
        retention: float | timedelta = 0.0,
        on_lost: str | LostAttempt = LostAttempt.RETRY,
        parked_blocks: bool = True,
        batch: int | None = None,
        time_limit: float | timedelta | None = None,
        max_lost: int = 5,
        heartbeat_timeout: float | timedelta = 30.0,
    ) -> Family:
        """Declare a family (its own queue ``<prefix>.<name>``) or replace a family's policy.

        ``per_actor``: at most this many rows of one actor run at once (Redis semaphores).
        ``ordered``: one actor's rows run one at a time in enqueue order; a parked row holds
        its actor's line unless ``parked_blocks=False``.
        ``time_limit``: a handler running longer has its attempt ended (a failure: retried or
        parked); prefork workers raise inside the handler, then kill it a little later.
        ``lease``: how long a claimed row's message may wait in the queue before it starts.
        ``heartbeat_timeout``: how long a started attempt may go without a heartbeat (sent
        every third of it while the handler runs) before it counts as lost and runs again.
        ``batch``: rows per delivery message. ``None`` (the default) sizes each claim's
        messages from its backlog: one row per message at low load, up to 100 under a backlog
        (spread over the consumers and bounded by the handlers' measured run time); ``n``
        caps that at n; ``1`` pins one row per message. Each row still starts, settles,
        retries and parks on its own.
        ``retention``: how long settled rows are kept (dedupe keys hold while the row is
        kept); ``math.inf`` or ``timedelta.max`` keeps them forever.
        """
        family_name(name)
        if per_actor is not None:
            self._need_redis(f"family {name!r} with per_actor={per_actor}")
        try:
            lost = LostAttempt(on_lost)
        except ValueError as exc:
            raise ConfigurationError(f"on_lost must be 'retry' or 'park', got {on_lost!r}") from exc
        keep = retention_seconds(retention)
        limit = None if time_limit is None else seconds(time_limit)
        beat = seconds(heartbeat_timeout)
        fam = Family(
            name,
            max_attempts=max_attempts,
            backoff=backoff or Backoff(),
            lease=seconds(lease),
            max_in_flight=max_in_flight,
            per_actor=per_actor,
            ordered=ordered,
            retention=keep,
            on_lost=lost,
            parked_blocks=parked_blocks,
            batch=batch,
            time_limit=limit,
            max_lost=max_lost,
            heartbeat_timeout=beat,
        )
        if fam.ordered and self.registry.capped_commands(name):
            raise ConfigurationError(
                f"family {name!r} is ordered: its handlers cannot set per_actor"
            )
        self.families[name] = fam
        if self.app.configured:
            self._apply_queues()
        return fam

    def _apply_queues(self) -> None:
        names = [self.claim_queue, *(self.queue_name(f) for f in self.families)]
        wiring.apply_queues(self.app, names)

    def handler(
        self,
        command: str,
        *,
        family: str = "intent",
        per_actor: int | None = None,
        transactional: bool = False,
    ) -> Callable[[HandlerFn], HandlerFn]:
        """Register ``fn(ctx, payload)`` as the handler of ``command``; ``per_actor``
        overrides the family's cap for this command's rows. A ``transactional`` handler gets
        ``ctx.conn``, a connection in a transaction that also settles its row: its writes and
        the settle commit together or not at all."""
        command_name(command)
        require_whole("per_actor", per_actor, optional=True)
        if per_actor is not None:
            self._need_redis(f"handler {command!r} with per_actor={per_actor}")
            fam = self.families.get(family)
            if fam is not None and fam.ordered:
                raise ConfigurationError(f"family {family!r} is ordered: per_actor does not apply")

        def decorate(fn: HandlerFn) -> HandlerFn:
            if not callable(fn):
                raise ConfigurationError(
                    f"the handler of {command!r} must be a function fn(ctx, payload), got {fn!r}"
                )
            if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
                # called, it returns a coroutine nobody awaits: its rows would settle as
                # delivered and the body would never run
                raise ConfigurationError(
                    f"the handler of {command!r} is async: handlers run in Celery's pool "
                    "processes, which run no event loop; write a plain function (it may call "
                    "asyncio.run(...))"
                )
            reg = Registration(command, family, fn, per_actor, transactional)
            self.registry.add(reg, set(self.families))
            return fn

        return decorate

    def _need_redis(self, what: str) -> None:
        if self.caps is None:
            raise ConfigurationError(
                f"{what} needs Redis for its cap semaphores: pass redis_url to Dispatcher()"
            )

    def is_capped(self, family: Family) -> bool:
        return family_is_capped(family, self.registry.capped_commands(family.name))

    def cap_rule(self, family: Family, command: str, actor: str | None) -> CapRule | None:
        """The cap a row counts against, or None when it is not capped."""
        return cap_rule(family, command, self.registry.cap_override(command), actor)

    def declare(self, command: str, *, family: str = "intent") -> None:
        """Let a producer enqueue ``command`` without running it (its handler lives elsewhere)."""
        command_name(command)
        self.registry.add(Registration(command, family, None), set(self.families))

    # -- enqueue --------------------------------------------------------------------------

    def enqueue(
        self,
        conn: TxConn,
        command: str,
        payload: Any = None,
        *,
        actor: str | None = None,
        dedupe_key: str | None = None,
        delay: timedelta | None = None,
        at: datetime | None = None,
        database: str | None = None,
    ) -> int:
        """Write one outbox row on the caller's connection, inside the caller's transaction:
        psycopg 3 or psycopg2, raw, Django's connection or a SQLAlchemy Session or Connection.

        Everything is validated before the row is written. With a dedupe key that already has a
        row, nothing is written and that row's id is returned. With several databases the row
        goes to the database of ``conn`` (``database=`` names it when a proxy hides it), and a
        connection to none of them is refused.
        """
        trace = tracing.current_context_json()
        row = self.writer.row(command, payload, actor, dedupe_key, delay, at, trace_json=trace)
        return self.writer.write(conn, row, database)

    async def aenqueue(
        self,
        conn: Any,
        command: str,
        payload: Any = None,
        *,
        actor: str | None = None,
        dedupe_key: str | None = None,
        delay: timedelta | None = None,
        at: datetime | None = None,
        database: str | None = None,
    ) -> int:
        """``enqueue`` on an async connection, awaited on it in the caller's transaction:
        psycopg 3's AsyncConnection, asyncpg's, or SQLAlchemy's AsyncSession or
        AsyncConnection (on psycopg or asyncpg)."""
        trace = tracing.current_context_json()
        row = self.writer.row(command, payload, actor, dedupe_key, delay, at, trace_json=trace)
        return await self.writer.awrite(conn, row, database)

    def enqueue_many(
        self, conn: TxConn, messages: Iterable[Message], *, database: str | None = None
    ) -> list[int]:
        """Write a batch, ids in input order, on the caller's connection as ``enqueue`` does.
        All of it is validated before anything is written."""
        return self.writer.write_many(conn, self.writer.rows(messages), database)

    async def aenqueue_many(
        self, conn: Any, messages: Iterable[Message], *, database: str | None = None
    ) -> list[int]:
        """``enqueue_many`` on an async connection, as ``aenqueue``."""
        return await self.writer.awrite_many(conn, self.writer.rows(messages), database)

    def database_of(self, conn: TxConn, name: str | None = None) -> Database:
        """The database the caller's connection writes to (``enqueue`` writes there); refused
        with UnknownDatabase when it is none of ours."""
        return self.writer.database(sync_caller(conn), name)

    def cancel(
        self,
        conn: TxConn,
        row_id: int | None = None,
        *,
        dedupe_key: str | None = None,
        actor: str | None = None,
        command: str | None = None,
        reason: str | None = None,
        by: str | None = None,
        database: str | None = None,
    ) -> CancelResult:
        """Cancel rows on the caller's connection (it commits with the caller): one row by id,
        by dedupe key, or every unsettled row of an actor (optionally of one command).

        Rows nobody is delivering are settled as cancelled at once; a running row's handler
        sees ``ctx.is_cancelled`` within one heartbeat (a third of the family's
        heartbeat_timeout), and its settle records the cancel. Cancelled rows keep who, when
        and why until their family's retention prunes them. Parked rows are not cancelled:
        purge them.
        """
        check_cancel(row_id, dedupe_key, actor, command, reason, by)
        ids = None if row_id is None else [row_id]
        now, requested = self.writer.cancel(
            conn,
            database,
            ids=ids,
            dedupe_key=dedupe_key,
            actor=actor,
            command=command,
            reason=reason,
            by=by,
        )
        return CancelResult(now, requested)

    async def acancel(
        self,
        conn: Any,
        row_id: int | None = None,
        *,
        dedupe_key: str | None = None,
        actor: str | None = None,
        command: str | None = None,
        reason: str | None = None,
        by: str | None = None,
        database: str | None = None,
    ) -> CancelResult:
        """``cancel`` on an async connection, as ``aenqueue``."""
        check_cancel(row_id, dedupe_key, actor, command, reason, by)
        ids = None if row_id is None else [row_id]
        now, requested = await self.writer.acancel(
            conn,
            database,
            ids=ids,
            dedupe_key=dedupe_key,
            actor=actor,
            command=command,
            reason=reason,
            by=by,
        )
        return CancelResult(now, requested)

    def ordered_families(self) -> dict[str, bool]:
        return {f.name: f.parked_blocks for f in self.families.values() if f.ordered}

    # -- tests, schema, shutdown ----------------------------------------------------------------

    def drain(self, timeout: float = 30.0, *, max_rounds: int = 100) -> DrainReport:
        """Claim and deliver in this process until nothing is due, in every database. For
        tests and scripts.

        Raises DrainLoop when deliveries keep making new due work for ``max_rounds`` rounds that
        each took every due row, and DrainTimeout when ``timeout`` seconds pass first.
        """
        parts = [(db.claimer, db.delivery) for db in self.databases.values()]
        return drain(parts, self.families, timeout, max_rounds)

    def migrate(self, database: str | None = None) -> list[int]:
        """Bring every database's outbox schema (or the named one's) up to date; returns the
        migrations applied (to any of them)."""
        applied: set[int] = set()
        for db in self.chosen_databases(database):
            applied.update(migrate(db.url, self.schema))
        return sorted(applied)

    def close(self) -> None:
        for db in self.databases.values():
            db.store.close()
        if self.caps is not None:
            self.caps.close()
