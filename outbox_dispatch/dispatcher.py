"""The public entry point: families, handlers, enqueue, Celery wiring and drain."""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import Celery

from outbox_dispatch.caps.semaphore import Caps
from outbox_dispatch.celery import tasks, wiring
from outbox_dispatch.celery.task_options import TaskCall
from outbox_dispatch.claim.claimer import Claimer, ClaimReport
from outbox_dispatch.claim.listener import CommitListener
from outbox_dispatch.claim.publisher import Publisher, family_command
from outbox_dispatch.claim.queues import QueueProbe
from outbox_dispatch.claim.runstats import RunStats, RunTimes
from outbox_dispatch.core import timings
from outbox_dispatch.core.bounds import (
    MAX_COUNT,
    MAX_INTERVAL,
    MAX_ROW_ID,
    count_in,
    real_seconds,
    seconds_in,
)
from outbox_dispatch.core.cron import CatchUp, Schedule
from outbox_dispatch.core.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidArgument,
    MaintenanceFailed,
    OutboxError,
    UnknownDatabase,
    UnknownFamily,
)
from outbox_dispatch.core.handlers import HandlerFn, Registration, Registry
from outbox_dispatch.core.logs import about_database, event, mask_dsn
from outbox_dispatch.core.naming import command_name, family_name, identifier
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
from outbox_dispatch.core.rows import Claimed, FamilyStatus
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.core.validation import (
    DEFAULT_PAYLOAD_LIMIT,
    Message,
    PreparedRow,
    checked_row_id,
    encode_payload,
    prepare,
    row_ids,
)
from outbox_dispatch.databases import Database, database_urls, pick, split_message
from outbox_dispatch.observe import metrics, tracing
from outbox_dispatch.store import Store
from outbox_dispatch.store.adapters import caller_connection
from outbox_dispatch.store.health import Breaker
from outbox_dispatch.store.maintenance import Maintenance
from outbox_dispatch.store.migrations import migrate
from outbox_dispatch.store.pool import Conn
from outbox_dispatch.worker.delivery import Delivery, Result
from outbox_dispatch.worker.drain import DrainReport, drain

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session as SASession

    # what enqueue and cancel accept: the connection (or session) of the caller's transaction
    TxConn = Conn | SAConnection | SASession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelResult:
    """Rows settled as cancelled at once, and running rows whose handler was asked to stop."""

    cancelled: list[int]
    requested: list[int]


class Dispatcher:
    """Wires the outbox into a Celery app. Nothing connects until it is used, so building one at
    import time (as Celery apps are) opens no sockets."""

    def __init__(
        self,
        app: Celery,
        *,
        database_url: str | None = None,
        databases: Mapping[str, str] | None = None,
        redis_url: str | None = None,
        schema: str = "outbox",
        queue_prefix: str = "outbox",
        claim_interval: float | timedelta = 1.0,
        claim_batch: int = 500,
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        pool_size: int = 4,
        handler_pool_size: int = 32,
        key_prefix: str = "outbox",
        prune_interval: float | timedelta = 60.0,
        prune_batch: int = 1000,
        listen: bool = True,
        consumers: int | None = None,
        task_family: str = "job",
        task_outside: str = "commit",
        flushed_starts: bool = False,
    ) -> None:
        urls = database_urls(database_url, databases)
        claim_interval = _interval("claim_interval", claim_interval)
        prune_interval = _interval("prune_interval", prune_interval)
        for name, count in (
            ("claim_batch", claim_batch),
            ("prune_batch", prune_batch),
            ("pool_size", pool_size),
            ("handler_pool_size", handler_pool_size),
        ):
            require_whole(name, count)
        require_whole("payload_limit", payload_limit, 2)
        require_whole("consumers", consumers, optional=True)
        for name, flag in (
            ("listen", listen),
            ("flushed_starts", flushed_starts),
        ):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{name} must be True or False, got {flag!r}")
        if task_outside not in tasks.OUTSIDE:
            raise ConfigurationError(
                f"task_outside must be one of {list(tasks.OUTSIDE)}, got {task_outside!r}"
            )
        self.task_outside = task_outside
        self.consumers = consumers
        self.app = app
        self.redis_url = redis_url
        self.schema = identifier(schema, "schema")
        self.queue_prefix = identifier(queue_prefix, "queue_prefix")
        self.claim_interval = claim_interval
        self.claim_batch = claim_batch
        self.payload_limit = payload_limit
        self.families: dict[str, Family] = builtin_families()
        self.registry = Registry(resolve=self._task_registration)
        self.caps = Caps(redis_url, key_prefix) if redis_url else None
        self.queues = QueueProbe(app, self.queue_name)
        several = len(urls) > 1  # then a database that stops answering is skipped (health.py)
        stores = {
            name: Store(
                url,
                self.schema,
                pool_size=pool_size,
                handler_pool_size=handler_pool_size,
                name=name,
                breaker=Breaker(name) if several else None,
                flushed_starts=flushed_starts,
            )
            for name, url in urls.items()
        }
        self.databases: dict[str, Database] = {
            name: self._database_parts(name, i == 0, stores) for i, name in enumerate(stores)
        }
        if self.caps is not None:
            self.caps.databases = [None if d.primary else d.name for d in self.databases.values()]
        first = next(iter(self.databases.values()))
        # the first database's parts under the names a one-database dispatcher always had
        self.database_url = first.url
        self.store, self.claimer, self.delivery = first.store, first.claimer, first.delivery
        self.maintenance = first.maintenance

        app.outbox_dispatcher = self  # lets `--app proj:celery_app` find us, as celery -A does
        wiring.write_settings(app)
        self._deliver_task, self._claim_task = wiring.register_tasks(
            app, self._deliver_from_queue, self.claim_and_publish
        )
        self.publisher = Publisher(app, self._deliver_task, self._shown_name)
        # with commit listeners, the leading one claims every claim_interval itself and beat's
        # entry is the safety net (listener.py): a claim task every second cost the deliveries
        # around it several ms each time
        beat_every = max(claim_interval, timings.SAFETY_INTERVAL) if listen else claim_interval
        wiring.add_beat_entry(app, beat_every, self.claim_queue)
        self.prune_batch = prune_batch
        wiring.register_periodic(app, wiring.PRUNE_TASK, self.prune)
        wiring.add_periodic_entry(
            app, "outbox-dispatch prune", wiring.PRUNE_TASK, prune_interval, self.claim_queue
        )
        self.schedules: dict[str, Schedule] = {}
        self._cron_task = wiring.register_periodic(app, wiring.CRON_TASK, self.run_cron)
        wiring.on_configured(app, self._apply_queues)
        self.listen = listen
        if listen:
            wiring.install_listener_step(app, self.commit_listeners)
        metrics.install_worker_server(app, self)
        for db in self.databases.values():
            wiring.on_worker_exit(db.delivery.deferred.flush)
        wiring.on_pool_process_start(self._warm_up)

        self.task_family = family_name(task_family)  # declared by the first call, if not yet

    def _warm_up(self) -> None:
        """A pool process opens its connection pools (in the background) and creates its
        metrics as it starts, so its first delivery waits for neither (10-40 ms and 50-60 ms,
        seen as the first rows' latency after a worker starts or recycles a child)."""
        metrics.warm()
        for db in self.databases.values():
            try:
                db.store.pools.main()
            except Exception as exc:  # the first delivery connects (and reports) instead
                event(log, logging.DEBUG, "pool_open_failed", repr(exc))

    def _database_parts(self, name: str, primary: bool, stores: dict[str, Store]) -> Database:
        """One database's claimer, delivery and maintenance over its store; the claimer sees
        every store, since a caps rebuild reads them all."""
        store = stores[name]
        claimer = Claimer(
            store,
            self.families,
            batch=self.claim_batch,
            caps=self.caps,
            cap_rule=self.cap_rule,
            is_capped=self.is_capped,
            queued=lambda family: self.queues.queued(family),
            consumers=self._consumers,
            run_stats=RunStats(store),
            database=name,
            primary=primary,
            all_stores=list(stores.values()),
        )
        delivery = Delivery(
            store,
            self.registry,
            self.families,
            caps=self.caps,
            cap_rule=self.cap_rule,
            on_slot_freed=self.request_claim,  # the database the freed slot's release named
            run_times=RunTimes(store),
            database=name,
            primary=primary,
        )
        maintenance = Maintenance(store, self.families)
        return Database(name, store.database_url, primary, store, claimer, delivery, maintenance)

    def commit_listener(self, database: str | None = None) -> CommitListener:
        """The commit listener of one database (the first by default) that a worker runs
        (listener.py); also usable on its own. It claims that database only."""
        db = self.database(database)
        return CommitListener(
            db.url,
            self.schema,
            db.store.channel,
            partial(self.claim_and_publish, database=db.name, refills=True),
            sweep=self.claim_interval,
            database=self._shown(db),
            trail=self.caps.wake_ms / 1000 if self.caps is not None else None,
        )

    def commit_listeners(self) -> list[CommitListener]:
        """One listener per database: each database's commits wake its own claims."""
        return [self.commit_listener(name) for name in self.databases]

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

    def _shown(self, db: Database) -> str | None:
        """The database name log lines carry: none with one database, as before."""
        return db.name if self.several else None

    def chosen_databases(self, name: str | None) -> list[Database]:
        """The one database named, or every database."""
        return list(self.databases.values()) if name is None else [self.database(name)]

    # -- declaration ----------------------------------------------------------------------

    @property
    def claim_queue(self) -> str:
        return f"{self.queue_prefix}.claim"

    def queue_name(self, family: str) -> str:
        return f"{self.queue_prefix}.{family}"

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
        keep = _retention_seconds(retention)
        limit = None if time_limit is None else _seconds(time_limit)
        beat = _seconds(heartbeat_timeout)
        fam = Family(
            name,
            max_attempts=max_attempts,
            backoff=backoff or Backoff(),
            lease=_seconds(lease),
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

    def request_claim(self, family: str, database: str | None = None) -> None:
        """Ask for a claim pass of ``family`` in ``database`` (None: the first) now (a slot
        freed while rows waited for one; the release script asks at most once per
        timings.WAKE_WINDOW): a NOTIFY to that database's commit listener, which claims in its
        own thread at once, or with ``listen=False`` a claim task on the claim queue, which
        waits for a free pool process behind the deliveries."""
        try:
            db = self.database(database)
            if self.listen:
                db.store.request_claim(family)
            else:
                args = ([family],) if db.primary else ([family], db.name)
                self._claim_task.apply_async(
                    args, queue=self.claim_queue, expires=self.claim_interval
                )
        except Exception as exc:  # the beat entry claims anyway; a request only speeds it up
            message = f"could not send a claim request: {exc!r}"
            event(log, logging.WARNING, "claim_request_failed", message)

    def queue_lengths(self) -> dict[str, int]:
        """Messages waiting in each family's broker queue (Flower does not show this); a family
        whose queue the broker cannot report is left out."""
        return self.queues.lengths(self.families.values())

    def declare(self, command: str, *, family: str = "intent") -> None:
        """Let a producer enqueue ``command`` without running it (its handler lives elsewhere)."""
        command_name(command)
        self.registry.add(Registration(command, family, None), set(self.families))

    # -- enqueue --------------------------------------------------------------------------

    def _prepare(
        self,
        command: str,
        payload: Any,
        actor: object,
        dedupe_key: object,
        delay: object,
        at: object,
        family: str | None = None,
        *,
        trace_json: str | None,
    ) -> PreparedRow:
        """A validated row; ``trace_json``: the caller's trace context (tracing.py), read once
        per call by the caller (for a batch of 5,000 rows, once per row was 20 % of its CPU)."""
        fam = self.registry.family_of(command) if family is None else family
        if fam not in self.families:
            raise UnknownFamily(f"command {command!r} belongs to undeclared family {fam!r}")
        row = prepare(
            family=fam,
            command=command,
            payload=payload,
            actor=actor,
            dedupe_key=dedupe_key,
            delay=delay,
            at=at,
            payload_limit=self.payload_limit,
        )
        return replace(row, trace_json=trace_json) if trace_json else row

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
        """Write one outbox row on the caller's connection, inside the caller's transaction.

        Everything is validated before the row is written. With a dedupe key that already has a
        row, nothing is written and that row's id is returned. With several databases the row
        goes to the database of ``conn`` (``database=`` names it when a proxy hides it), and a
        connection to none of them is refused.
        """
        trace_json = tracing.current_context_json()
        row = self._prepare(command, payload, actor, dedupe_key, delay, at, trace_json=trace_json)
        raw = caller_connection(conn)
        return self._insert(self._database_of(conn, raw, database), raw, row)

    def enqueue_call(
        self, conn: object, task: str, call: TaskCall, family: str, database: str | None = None
    ) -> int:
        """The row of a Celery task call (tasks.py) on the caller's connection; with
        ``conn=None``, in a transaction of its own, committed before this returns."""
        row = self._prepare(
            task,
            call.payload,
            call.actor,
            call.dedupe_key,
            call.delay,
            call.at,
            family,
            trace_json=tracing.current_context_json(),
        )
        due_now = call.delay is None and call.at is None
        if conn is not None:
            raw = caller_connection(conn)
            db = self._database_of(conn, raw, database)
            row_id = self._insert(db, raw, row)
            self._same_command(db.store, raw, row_id, task, call)
            if due_now and type(conn).__module__.startswith("django."):
                from outbox_dispatch.celery.transactions import wake_on_commit

                wake_on_commit(conn, self, [family])  # only when nobody listens
            return row_id
        first = self.database()  # outside any transaction: the first database's outbox
        with first.store.connection() as own:
            row_id = self._insert(first, own, row)
            self._same_command(first.store, own, row_id, task, call)
        if not self.listen and due_now:
            self.request_claim(family)  # committed: the NOTIFY wakes only a listener
        return row_id

    def database_of(self, conn: TxConn, name: str | None = None) -> Database:
        """The database the caller's connection writes to (``enqueue`` writes there); refused
        with UnknownDatabase when it is none of ours."""
        return self._database_of(conn, caller_connection(conn), name)

    def _database_of(self, conn: object, raw: Conn, name: str | None) -> Database:
        """The database a caller's connection writes to; a Django connection whose alias is
        one of our database names is that database."""
        alias = getattr(conn, "alias", None) if name is None else None
        if isinstance(alias, str) and alias in self.databases and self.several:
            name = alias
        return pick(self.databases, raw, name)

    def _same_command(
        self, store: Store, conn: Conn, row_id: int, task: str, call: TaskCall
    ) -> None:
        """A dedupe key already held by another command's row would hand this call that row:
        refused, so that one task's call is never silently taken for another's."""
        if call.dedupe_key is None:
            return
        holder = store.command_of(conn, row_id)
        if holder is not None and holder != task:
            raise InvalidArgument(
                f"{task}: dedupe key {call.dedupe_key!r} is held by row {row_id} of "
                f"{holder!r}; give each task's calls keys of their own"
            )

    def _insert(self, db: Database, conn: Conn, row: PreparedRow) -> int:
        fam = self.families[row.family]
        if fam.ordered and row.actor is not None:
            return db.store.insert_ordered(conn, row, parked_blocks=fam.parked_blocks)
        return db.store.insert(conn, row)

    def _task_registration(self, command: str) -> Registration | None:
        """A Celery task of the app, for rows its calls wrote (its handler runs the task)."""
        if command.startswith(tasks.INTERNAL):
            return None
        task = self.app.tasks.get(command)  # finalizes the app: only ever at delivery
        if task is None:
            return None
        run = partial(tasks.run_task, task, self.queue_name)
        return Registration(command, self.task_family, run, task=True)

    def _shown_name(self, family: Family, command: str) -> str:
        """Flower's name for a delivery: ``<family>:<command>``, a task's calls its own name."""
        reg = self.registry.registration(command)
        return command if reg is not None and reg.task else family_command(family, command)

    def enqueue_many(
        self, conn: TxConn, messages: Iterable[Message], *, database: str | None = None
    ) -> list[int]:
        """Write a batch in one round trip; ids come back in input order. All or nothing is
        validated before anything is written. The database is chosen as for ``enqueue``."""
        rows = []
        trace_json = tracing.current_context_json()  # one context for the whole batch
        for m in messages:
            if not isinstance(m, Message):
                raise InvalidArgument(f"enqueue_many takes Message objects, got {type(m).__name__}")
            rows.append(
                self._prepare(
                    m.command,
                    m.payload,
                    m.actor,
                    m.dedupe_key,
                    m.delay,
                    m.at,
                    trace_json=trace_json,
                )
            )
        raw = caller_connection(conn)
        db = self._database_of(conn, raw, database)
        return db.store.insert_many(raw, rows, self._ordered_families())

    # -- claim, publish, deliver ----------------------------------------------------------

    def publish(
        self, family: Family, rows: Sequence[Claimed], size: int = 1, database: str | None = None
    ) -> None:
        """One message per row, or per ``size`` rows; all on one producer connection. The
        messages name ``database`` unless it is the first."""
        if rows:
            db = self.database(database)
            named = None if db.primary else db.name
            self.publisher.publish(family, rows, self.queue_name(family.name), size, named)

    def _consumers(self) -> int:
        """How many processes consume a family's queue at least: the ``consumers`` setting, or
        this worker's concurrency (the run-time reports add the processes seen delivering)."""
        if self.consumers is not None:
            return self.consumers
        return int(self.app.conf.worker_concurrency or os.cpu_count() or 1)

    def claim_and_publish(
        self,
        families: list[str] | None = None,
        database: str | None = None,
        *,
        refills: bool = False,
    ) -> ClaimReport:
        """One claimer pass (the beat task): claim each family's (or the named families') due
        rows and publish them, in every database (or the one named). A database that fails
        is logged and skipped: the others' rows go on. ``refills``: the caller claims again
        within a refill interval (a commit listener), so a family whose queue already holds
        work for every consumer is left for then (Claimer.run)."""
        chosen = self.chosen_databases(database)
        if len(chosen) == 1:
            return self._claim_pass(chosen[0], families, refills=refills)
        report = ClaimReport()
        budget = self.claim_interval / len(chosen)  # the pass fits its interval, as with one
        for db in chosen:
            try:
                part = self._claim_pass(db, families, budget, refills=refills)
            except OutboxError as exc:
                # a database known to be down is said once per probe, not once per pass
                known = isinstance(exc, DatabaseUnavailable) and exc.repeated
                with about_database(db.name):
                    level = logging.DEBUG if known else logging.WARNING
                    event(log, level, "claim_failed", str(exc))
                continue
            report.merge(part)
        return report

    def _claim_pass(
        self,
        db: Database,
        families: list[str] | None,
        budget: float | None = None,
        *,
        refills: bool = False,
    ) -> ClaimReport:
        with about_database(self._shown(db)):
            publish = partial(self._publish_to, db.name)
            budget = self.claim_interval if budget is None else budget
            report = db.claimer.run(publish, budget=budget, only=families, refills=refills)
            if report.total:
                event(log, logging.INFO, "claim_pass", f"published {report.claimed}")
        return report

    def _publish_to(self, database: str, family: Family, rows: list[Claimed], size: int) -> None:
        self.publish(family, rows, size, database)

    def _deliver_from_queue(
        self, args: tuple[Any, ...], routing_key: str | None, stop_at: float | None = None
    ) -> list[Result]:
        prefix = self.queue_prefix + "."
        hint = (
            routing_key[len(prefix) :] if routing_key and routing_key.startswith(prefix) else None
        )
        name, rest = split_message(args)
        db = self.database() if name is None else self.databases.get(name)
        if db is None:  # a forged or foreign name: dropped like any stale message
            shown = repr(name)[:60]
            event(log, logging.WARNING, "stale_dropped", f"message names no database {shown}")
            metrics.outcome(hint, Outcome.STALE.value, "unknown")
            return [Result(Outcome.STALE, None, f"unknown database {shown}")]
        with about_database(self._shown(db)):
            try:
                return db.delivery.deliver_message(
                    rest, family_hint=hint, defer=True, stop_at=stop_at
                )
            except DatabaseUnavailable as exc:
                # acked without a start: its rows are claimed again after their lease, once the
                # database is back, and this pool process moves on to other databases' rows
                level = logging.INFO if exc.repeated else logging.WARNING
                event(log, level, "stale_dropped", f"{exc}; the message is dropped")
                metrics.outcome(hint, Outcome.STALE.value, db.name)
                return [Result(Outcome.STALE, None, f"database {db.name!r} is down")]

    def drain(self, timeout: float = 30.0, *, max_rounds: int = 100) -> DrainReport:
        """Claim and deliver in this process until nothing is due, in every database. For
        tests and scripts.

        Raises DrainLoop when deliveries keep making new due work for ``max_rounds`` rounds that
        each took every due row, and DrainTimeout when ``timeout`` seconds pass first.
        """
        parts = [(db.claimer, db.delivery) for db in self.databases.values()]
        return drain(parts, self.families, timeout, max_rounds)

    # -- operations -----------------------------------------------------------------------

    def migrate(self, database: str | None = None) -> list[int]:
        """Bring every database's outbox schema (or the named one's) up to date; returns the
        migrations applied (to any of them)."""
        applied: set[int] = set()
        for db in self.chosen_databases(database):
            applied.update(migrate(db.url, self.schema))
        return sorted(applied)

    def status(self, database: str | None = None) -> list[FamilyStatus]:
        """Each family's counts in each database (or the one named)."""
        out: list[FamilyStatus] = []
        for db in self.chosen_databases(database):
            out += [replace(s, database=db.name) for s in self._status_of(db)]
        return out

    def _status_of(self, db: Database) -> list[FamilyStatus]:
        seen = {s.family: s for s in db.store.status()}
        out = [seen.pop(name, FamilyStatus(name, 0, 0, 0, 0, 0, 0, 0.0)) for name in self.families]
        out += list(seen.values())
        special = [f for f in self.families.values() if f.ordered or self.is_capped(f)]
        if not special:
            return out
        counts, actors = db.store.cap_status([f.name for f in special])
        at_cap: dict[str, int] = {}
        for fam_name, _actor, n in actors:
            fam = self.families[fam_name]
            if self.is_capped(fam) and fam.per_actor is not None and n >= fam.per_actor:
                at_cap[fam_name] = at_cap.get(fam_name, 0) + 1
        return [
            replace(
                s,
                waiting=counts.get(s.family, (0, 0))[0],
                blocked=counts.get(s.family, (0, 0))[1],
                actors_at_cap=at_cap.get(s.family, 0),
            )
            for s in out
        ]

    def parked_retry(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        database: str | None = None,
    ) -> list[int]:
        """Parked rows due again with attempts reset; in an ordered family they get back in line
        behind the actor's head (or become it). Row ids are per database: with several, ids
        need ``database``; without ids, every database's (or the named one's) rows."""
        ids = row_ids(ids)
        ordered = self._ordered_families()
        return [
            i
            for db in self._row_databases(ids, database)
            for i in db.store.parked_retry(ids=ids, family=family, ordered=ordered)
        ]

    def parked_purge(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        database: str | None = None,
    ) -> list[int]:
        """Delete parked rows; an ordered actor whose parked head is gone gets its next row.
        Databases are chosen as for ``parked_retry``."""
        ids = row_ids(ids)
        ordered = self._ordered_families()
        return [
            i
            for db in self._row_databases(ids, database)
            for i in db.store.parked_purge(ids=ids, family=family, ordered=ordered)
        ]

    def parked_list(
        self, *, family: str | None = None, limit: int | None = 100, database: str | None = None
    ) -> list[dict[str, Any]]:
        """Parked rows, oldest first, up to ``limit`` per database (None: all); each names its
        database."""
        if limit is not None and not count_in(limit, 0, MAX_ROW_ID):
            raise InvalidArgument(f"limit must be None or a whole number from 0, got {limit!r}")
        return [
            {"database": db.name, **row}
            for db in self.chosen_databases(database)
            for row in db.store.parked_list(family=family, limit=limit)
        ]

    def _row_databases(self, ids: list[int] | None, database: str | None) -> list[Database]:
        """Row ids mean a row in one database: with several, they need its name."""
        if ids and database is None and self.several:
            raise InvalidArgument(
                "row ids are per database and this dispatcher has "
                f"{', '.join(map(repr, self.databases))}: name the database of the ids"
            )
        return self.chosen_databases(database)

    def _ordered_families(self) -> dict[str, bool]:
        return {f.name: f.parked_blocks for f in self.families.values() if f.ordered}

    # -- cancellation, retention, cron ------------------------------------------------------

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
        heartbeat_timeout), and its settle records the
        cancel. Cancelled rows keep who, when and why until their family's retention prunes
        them. Parked rows are not cancelled: purge them.
        """
        if row_id is None and dedupe_key is None and actor is None:
            raise InvalidArgument("cancel needs a row id, a dedupe_key, or an actor")
        if sum(x is not None for x in (row_id, dedupe_key, actor)) > 1:
            # they used to narrow each other, and a pending row matched nothing
            raise InvalidArgument(
                "cancel takes one of a row id, a dedupe_key or an actor: cancel each separately"
            )
        if command is not None and actor is None:
            raise InvalidArgument("command narrows an actor's rows: pass actor= with it")
        if row_id is not None:
            checked_row_id(row_id)
        for what, value in (
            ("dedupe_key", dedupe_key),
            ("actor", actor),
            ("command", command),
            ("reason", reason),
            ("by", by),
        ):
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
        ordered = self._ordered_families()
        raw = caller_connection(conn)
        now, requested = self._database_of(conn, raw, database).store.cancel(
            raw,
            ids=None if row_id is None else [row_id],
            dedupe_key=dedupe_key,
            actor=actor,
            command=command,
            reason=reason,
            by=by,
            ordered=ordered,
        )
        return CancelResult(now, requested)

    def prune(
        self,
        *,
        batch: int | None = None,
        max_batches: int = 100,
        progress: Callable[[str, int], None] | None = None,
        database: str | None = None,
    ) -> dict[str, int]:
        """Delete delivered and cancelled rows past their family's retention, in batches of
        ``batch`` rows (short transactions, never one long lock); ``progress(family, deleted so
        far)`` is called after each batch that deleted something. Also repairs ordered lines a
        crash left without a head; one family's failure does not stop the others', nor one
        database's the others'."""
        for name, value in (("batch", batch), ("max_batches", max_batches)):
            if value is not None and not count_in(value, 1):
                raise InvalidArgument(
                    f"prune {name} must be a whole number from 1 to {MAX_COUNT}, got {value!r}"
                )
        total: dict[str, int] = {}
        failed: list[str] = []
        for db in self.chosen_databases(database):
            try:
                with about_database(self._shown(db)):
                    part = db.maintenance.prune(
                        batch=batch or self.prune_batch, max_batches=max_batches, progress=progress
                    )
            except OutboxError as exc:
                if len(self.databases) == 1:
                    raise
                failed.append(db.name)
                with about_database(db.name):
                    event(log, logging.ERROR, "maintenance_failed", f"{exc}")
                continue
            for family, n in part.items():
                total[family] = total.get(family, 0) + n
        if failed:
            raise MaintenanceFailed(
                f"maintenance failed in databases {failed}; it is tried again next pass"
            )
        return total

    def cron(
        self,
        name: str,
        expr: str,
        command: str,
        payload: Any = None,
        *,
        tz: str = "UTC",
        catch_up: str | CatchUp = CatchUp.LATEST,
        window: timedelta = timedelta(hours=1),
        check_every: float = 1.0,
    ) -> Schedule:
        """Write one ``command`` row per tick of ``expr`` (five cron fields, or six with
        seconds last). After downtime, ``catch_up="latest"`` writes only the latest missed tick,
        ``"all"`` every missed tick within ``window``. A new schedule starts with the next tick.
        """
        if not isinstance(name, str) or not name or len(name) > 100:
            raise ConfigurationError(f"cron name must be a 1-100 character str, got {name!r}")
        try:
            policy = CatchUp(catch_up)
        except ValueError as exc:
            raise ConfigurationError(
                f"catch_up must be 'latest' or 'all', got {catch_up!r}"
            ) from exc
        self.registry.family_of(command)  # the command must be known
        every = real_seconds(check_every)
        if every is None or not (seconds_in(every, 0.0, MAX_INTERVAL) and every > 0):
            raise ConfigurationError(
                f"check_every must be seconds above 0 and at most {MAX_INTERVAL:g}, "
                f"got {check_every!r}"
            )
        schedule = Schedule(name, expr, command, payload, tz, policy, window)
        # a payload that cannot be stored fails here, at declaration, not at every tick
        encode_payload(schedule.payload_for(datetime.now(UTC)), self.payload_limit)
        known = self.schedules.get(name)
        if known is not None and known != schedule:
            # two schedules of one name share its tick record: one of them would lose ticks
            raise ConfigurationError(
                f"cron schedule {name!r} is already declared ({known.expr!r}, "
                f"{known.command!r}): give each schedule its own name"
            )
        first = not self.schedules
        self.schedules[name] = schedule
        if first:
            wiring.add_periodic_entry(
                self.app, "outbox-dispatch cron", wiring.CRON_TASK, every, self.claim_queue
            )
        return schedule

    def run_cron(self, now: datetime | None = None) -> dict[str, int]:
        """Write the rows of every schedule's due ticks, in the first database; safe to run
        from several processes."""
        first = self.database()
        enqueue = partial(self.enqueue, database=first.name)
        return first.maintenance.run_cron(self.schedules.values(), enqueue, now)

    def close(self) -> None:
        for db in self.databases.values():
            db.store.close()
        if self.caps is not None:
            self.caps.close()


def _interval(name: str, value: float | timedelta) -> float:
    """An interval of the Dispatcher as float seconds: any real number or a timedelta, above 0
    and at most MAX_INTERVAL (beat's schedule and the listener's sweep take no more)."""
    seconds = real_seconds(value)
    if seconds is None or not (seconds_in(seconds, 0.0, MAX_INTERVAL) and seconds > 0):
        raise ConfigurationError(
            f"{name} must be seconds (a number or a timedelta) > 0 and <= {MAX_INTERVAL:g}, "
            f"got {value!r}"
        )
    return seconds


def _seconds(value: float | timedelta) -> float:
    """Seconds as a float from any real number or a timedelta; anything else is passed on
    for the family's own check to refuse with its name."""
    seconds = real_seconds(value)
    return value if seconds is None else seconds  # type: ignore[return-value]


def _retention_seconds(retention: object) -> float:
    """Seconds to keep settled rows; ``timedelta.max`` and ``math.inf`` mean forever."""
    if isinstance(retention, timedelta):
        return math.inf if retention == timedelta.max else retention.total_seconds()
    if isinstance(retention, bool) or not isinstance(retention, int | float):
        raise ConfigurationError(
            f"retention must be seconds or a timedelta, got {type(retention).__name__}"
        )
    return float(retention)
