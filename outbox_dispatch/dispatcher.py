"""The public entry point: families, handlers, enqueue, Celery wiring and drain."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import Celery

from . import metrics, tasks, tracing, wiring
from .adapters import caller_connection, check_database_url
from .caps import Caps
from .claimer import Claimer, ClaimReport
from .cron import CatchUp, Schedule
from .delivery import Delivery, Result
from .drain import DrainReport, drain
from .errors import (
    ConfigurationError,
    InvalidArgument,
    UnknownFamily,
)
from .handlers import HandlerFn, Registration, Registry
from .listener import CommitListener
from .logs import event
from .maintenance import Maintenance
from .migrations import migrate
from .naming import family_name, identifier
from .policy import (
    Backoff,
    CapRule,
    Family,
    LostAttempt,
    builtin_families,
    cap_rule,
    family_is_capped,
)
from .pool import Conn
from .publisher import Publisher, family_command
from .queues import QueueProbe
from .rows import Claimed, FamilyStatus
from .runstats import RunStats, RunTimes
from .store import Store
from .task_options import TaskCall
from .validation import DEFAULT_PAYLOAD_LIMIT, Message, PreparedRow, encode_payload, prepare

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
        database_url: str,
        redis_url: str | None = None,
        schema: str = "outbox",
        queue_prefix: str = "outbox",
        claim_interval: float = 1.0,
        claim_batch: int = 500,
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        pool_size: int = 4,
        handler_pool_size: int = 32,
        key_prefix: str = "outbox",
        prune_interval: float = 60.0,
        prune_batch: int = 1000,
        listen: bool = True,
        consumers: int | None = None,
        task_family: str = "job",
        task_outside: str = "commit",
    ) -> None:
        if not database_url:
            raise ConfigurationError("database_url is required (a postgresql:// URL or DSN)")
        check_database_url(database_url)
        if claim_interval <= 0:
            raise ConfigurationError("claim_interval must be > 0 seconds")
        if claim_batch < 1:
            raise ConfigurationError("claim_batch must be >= 1")
        if payload_limit < 2:
            raise ConfigurationError("payload_limit must be at least 2 bytes")
        if consumers is not None and (
            isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1
        ):
            raise ConfigurationError(f"consumers must be None or >= 1, got {consumers!r}")
        if task_outside not in tasks.OUTSIDE:
            raise ConfigurationError(
                f"task_outside must be one of {list(tasks.OUTSIDE)}, got {task_outside!r}"
            )
        self.task_outside = task_outside
        self.consumers = consumers
        self.app = app
        self.database_url = database_url
        self.redis_url = redis_url
        self.schema = identifier(schema, "schema")
        self.queue_prefix = identifier(queue_prefix, "queue_prefix")
        self.claim_interval = claim_interval
        self.payload_limit = payload_limit
        self.families: dict[str, Family] = builtin_families()
        self.registry = Registry(resolve=self._task_registration)
        if pool_size < 1 or handler_pool_size < 1:
            raise ConfigurationError("pool_size and handler_pool_size must be >= 1")
        self.store = Store(
            database_url, self.schema, pool_size=pool_size, handler_pool_size=handler_pool_size
        )
        self.caps = Caps(redis_url, key_prefix) if redis_url else None
        self.queues = QueueProbe(app, self.queue_name)
        self.claimer = Claimer(
            self.store,
            self.families,
            batch=claim_batch,
            caps=self.caps,
            cap_rule=self.cap_rule,
            is_capped=self.is_capped,
            queued=lambda family: self.queues.queued(family),
            consumers=self._consumers,
            run_stats=RunStats(self.store),
        )
        self.delivery = Delivery(
            self.store,
            self.registry,
            self.families,
            caps=self.caps,
            cap_rule=self.cap_rule,
            on_slot_freed=self.request_claim,
            run_times=RunTimes(self.store),
        )

        app.outbox_dispatcher = self  # lets `--app proj:celery_app` find us, as celery -A does
        wiring.write_settings(app)
        self._deliver_task, self._claim_task = wiring.register_tasks(
            app, self._deliver_from_queue, self.claim_and_publish
        )
        self.publisher = Publisher(app, self._deliver_task, self._shown_name)
        wiring.add_beat_entry(app, claim_interval, self.claim_queue)
        self.prune_batch = prune_batch
        self.maintenance = Maintenance(self.store, self.families)
        wiring.register_periodic(app, wiring.PRUNE_TASK, self.prune)
        wiring.add_periodic_entry(
            app, "outbox-dispatch prune", wiring.PRUNE_TASK, prune_interval, self.claim_queue
        )
        self.schedules: dict[str, Schedule] = {}
        self._cron_task = wiring.register_periodic(app, wiring.CRON_TASK, self.run_cron)
        wiring.on_configured(app, self._apply_queues)
        self.listen = listen
        if listen:
            wiring.install_listener_step(app, self.commit_listener)
        metrics.install_worker_server(app, self)
        wiring.on_worker_exit(self.delivery.deferred.flush)

        self.task_family = family_name(task_family)  # declared by the first call, if not yet

    def commit_listener(self) -> CommitListener:
        """The commit listener a worker runs (listener.py); also usable on its own."""
        return CommitListener(
            self.database_url, self.schema, self.store.channel, self.claim_and_publish
        )

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
            lease=float(lease),
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
        if not isinstance(command, str) or not command or len(command) > 200:
            raise ConfigurationError(f"command must be a 1-200 character str, got {command!r}")
        if per_actor is not None:
            if isinstance(per_actor, bool) or not isinstance(per_actor, int) or per_actor < 1:
                raise ConfigurationError(f"per_actor must be None or >= 1, got {per_actor!r}")
            self._need_redis(f"handler {command!r} with per_actor={per_actor}")
            fam = self.families.get(family)
            if fam is not None and fam.ordered:
                raise ConfigurationError(f"family {family!r} is ordered: per_actor does not apply")

        def decorate(fn: HandlerFn) -> HandlerFn:
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

    def request_claim(self, family: str) -> None:
        """Ask for a claim pass of ``family`` now (a slot freed; the release script asks at
        most once per 100 ms window): a NOTIFY to the commit listener, which claims in its own
        thread at once, or with ``listen=False`` a claim task on the claim queue, which waits
        for a free pool process behind the deliveries."""
        try:
            if self.listen:
                self.store.request_claim(family)
            else:
                self._claim_task.apply_async(
                    ([family],), queue=self.claim_queue, expires=self.claim_interval
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
        if not isinstance(command, str) or not command or len(command) > 200:
            raise ConfigurationError(f"command must be a 1-200 character str, got {command!r}")
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
    ) -> PreparedRow:
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
        trace_json = tracing.current_context_json()
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
    ) -> int:
        """Write one outbox row on the caller's connection, inside the caller's transaction.

        Everything is validated before the row is written. With a dedupe key that already has a
        row, nothing is written and that row's id is returned.
        """
        row = self._prepare(command, payload, actor, dedupe_key, delay, at)
        return self._insert(caller_connection(conn), row)

    def enqueue_call(self, conn: object, task: str, call: TaskCall, family: str) -> int:
        """The row of a Celery task call (tasks.py) on the caller's connection; with
        ``conn=None``, in a transaction of its own, committed before this returns."""
        row = self._prepare(
            task, call.payload, call.actor, call.dedupe_key, call.delay, call.at, family
        )
        due_now = call.delay is None and call.at is None
        if conn is not None:
            row_id = self._insert(caller_connection(conn), row)
            self._same_command(caller_connection(conn), row_id, task, call)
            if due_now and type(conn).__module__.startswith("django."):
                from .contrib.django import wake_on_commit

                wake_on_commit(conn, self, [family])  # only when nobody listens
            return row_id
        with self.store.connection() as own:
            row_id = self._insert(own, row)
            self._same_command(own, row_id, task, call)
        if not self.listen and due_now:
            self.request_claim(family)  # committed: the NOTIFY wakes only a listener
        return row_id

    def _same_command(self, conn: Conn, row_id: int, task: str, call: TaskCall) -> None:
        """A dedupe key already held by another command's row would hand this call that row:
        refused, so that one task's call is never silently taken for another's."""
        if call.dedupe_key is None:
            return
        holder = self.store.command_of(conn, row_id)
        if holder is not None and holder != task:
            raise InvalidArgument(
                f"{task}: dedupe key {call.dedupe_key!r} is held by row {row_id} of "
                f"{holder!r}; give each task's calls keys of their own"
            )

    def _insert(self, conn: Conn, row: PreparedRow) -> int:
        fam = self.families[row.family]
        if fam.ordered and row.actor is not None:
            return self.store.insert_ordered(conn, row, parked_blocks=fam.parked_blocks)
        return self.store.insert(conn, row)

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

    def enqueue_many(self, conn: TxConn, messages: Iterable[Message]) -> list[int]:
        """Write a batch in one round trip; ids come back in input order. All or nothing is
        validated before anything is written."""
        rows = []
        for m in messages:
            if not isinstance(m, Message):
                raise InvalidArgument(f"enqueue_many takes Message objects, got {type(m).__name__}")
            rows.append(self._prepare(m.command, m.payload, m.actor, m.dedupe_key, m.delay, m.at))
        return self.store.insert_many(caller_connection(conn), rows, self._ordered_families())

    # -- claim, publish, deliver ----------------------------------------------------------

    def publish(self, family: Family, rows: Sequence[Claimed], size: int = 1) -> None:
        """One message per row, or per ``size`` rows; all on one producer connection."""
        if rows:
            self.publisher.publish(family, rows, self.queue_name(family.name), size)

    def _consumers(self) -> int:
        """How many processes consume a family's queue at least: the ``consumers`` setting, or
        this worker's concurrency (the run-time reports add the processes seen delivering)."""
        if self.consumers is not None:
            return self.consumers
        return int(self.app.conf.worker_concurrency or os.cpu_count() or 1)

    def claim_and_publish(self, families: list[str] | None = None) -> ClaimReport:
        """One claimer pass (the beat task): claim each family's (or the named families') due
        rows and publish them."""
        report = self.claimer.run(self.publish, budget=self.claim_interval, only=families)
        if report.total:
            event(log, logging.INFO, "claim_pass", f"published {report.claimed}")
        return report

    def _deliver_from_queue(self, args: tuple[Any, ...], routing_key: str | None) -> list[Result]:
        prefix = self.queue_prefix + "."
        hint = (
            routing_key[len(prefix) :] if routing_key and routing_key.startswith(prefix) else None
        )
        return self.delivery.deliver_message(args, family_hint=hint, defer=True)

    def drain(self, timeout: float = 30.0, *, max_rounds: int = 100) -> DrainReport:
        """Claim and deliver in this process until nothing is due. For tests and scripts.

        Raises DrainLoop when deliveries keep making new due work for ``max_rounds`` rounds that
        each took every due row, and DrainTimeout when ``timeout`` seconds pass first.
        """
        return drain(self.claimer, self.delivery, self.families, timeout, max_rounds)

    # -- operations -----------------------------------------------------------------------

    def migrate(self) -> list[int]:
        return migrate(self.database_url, self.schema)

    def status(self) -> list[FamilyStatus]:
        seen = {s.family: s for s in self.store.status()}
        out = [seen.pop(name, FamilyStatus(name, 0, 0, 0, 0, 0, 0, 0.0)) for name in self.families]
        out += list(seen.values())
        special = [f for f in self.families.values() if f.ordered or self.is_capped(f)]
        if not special:
            return out
        counts, actors = self.store.cap_status([f.name for f in special])
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

    def parked_retry(self, *, ids: list[int] | None = None, family: str | None = None) -> list[int]:
        """Parked rows due again with attempts reset; in an ordered family they get back in line
        behind the actor's head (or become it)."""
        return self.store.parked_retry(ids=ids, family=family, ordered=self._ordered_families())

    def parked_purge(self, *, ids: list[int] | None = None, family: str | None = None) -> list[int]:
        """Delete parked rows; an ordered actor whose parked head is gone gets its next row."""
        return self.store.parked_purge(ids=ids, family=family, ordered=self._ordered_families())

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
        if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, int)):
            raise InvalidArgument(f"row_id must be an int, got {type(row_id).__name__}")
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
        now, requested = self.store.cancel(
            caller_connection(conn),
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
    ) -> dict[str, int]:
        """Delete delivered and cancelled rows past their family's retention, in batches of
        ``batch`` rows (short transactions, never one long lock); ``progress(family, deleted so
        far)`` is called after each batch that deleted something. Also repairs ordered lines a
        crash left without a head; one family's failure does not stop the others'."""
        return self.maintenance.prune(
            batch=batch or self.prune_batch, max_batches=max_batches, progress=progress
        )

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
        schedule = Schedule(name, expr, command, payload, tz, policy, window)
        # a payload that cannot be stored fails here, at declaration, not at every tick
        encode_payload(schedule.payload_for(datetime.now(UTC)), self.payload_limit)
        first = not self.schedules
        self.schedules[name] = schedule
        if first:
            wiring.add_periodic_entry(
                self.app, "outbox-dispatch cron", wiring.CRON_TASK, check_every, self.claim_queue
            )
        return schedule

    def run_cron(self, now: datetime | None = None) -> dict[str, int]:
        """Write the rows of every schedule's due ticks; safe to run from several processes."""
        return self.maintenance.run_cron(self.schedules.values(), self.enqueue, now)

    def close(self) -> None:
        self.store.close()
        if self.caps is not None:
            self.caps.close()


def _seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else value


def _retention_seconds(retention: object) -> float:
    """Seconds to keep settled rows; ``timedelta.max`` and ``math.inf`` mean forever."""
    if isinstance(retention, timedelta):
        return math.inf if retention == timedelta.max else retention.total_seconds()
    if isinstance(retention, bool) or not isinstance(retention, int | float):
        raise ConfigurationError(
            f"retention must be seconds or a timedelta, got {type(retention).__name__}"
        )
    return float(retention)
