"""What Celery runs for a Dispatcher: claim passes over its databases (the beat task and the
commit listeners), publishing claimed rows, delivery messages in pool processes, and claim
requests. Users do not call this; the Dispatcher builds it and Celery's tasks call into it."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from outbox_dispatch.caps.semaphore import Caps
from outbox_dispatch.celery import tasks, wiring
from outbox_dispatch.celery.run import run_task
from outbox_dispatch.claim.claimer import Claimer, ClaimReport
from outbox_dispatch.claim.listener import CommitListener
from outbox_dispatch.claim.publisher import Publisher, family_command
from outbox_dispatch.claim.queues import QueueProbe
from outbox_dispatch.claim.runstats import RunStats, RunTimes
from outbox_dispatch.core.errors import DatabaseUnavailable, OutboxError
from outbox_dispatch.core.handlers import Registration
from outbox_dispatch.core.logs import about_database, event
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.databases import Database, split_message
from outbox_dispatch.observe import metrics
from outbox_dispatch.store import Store
from outbox_dispatch.store.health import Breaker
from outbox_dispatch.store.maintenance import Maintenance
from outbox_dispatch.worker.delivery import Delivery
from outbox_dispatch.worker.messages import Result

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)


class Runtime:
    """The claim and delivery side of one Dispatcher (``dispatcher.runtime``)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.settings = dispatcher.settings
        self.queues = QueueProbe(dispatcher.app, dispatcher.queue_name)
        self.deliver_task, self.claim_task = wiring.register_tasks(
            dispatcher.app, self.deliver_from_queue, self.claim_and_publish
        )
        self.publisher = Publisher(dispatcher.app, self.deliver_task, self.shown_name)

    def build_databases(self, caps: Caps | None) -> dict[str, Database]:
        """Each database's store, claimer, delivery and maintenance; a claimer sees every
        store, since a caps rebuild reads them all."""
        s, d = self.settings, self.dispatcher
        several = len(s.urls) > 1  # then a database that is down is skipped (store/health.py)
        stores = {
            name: Store(
                url,
                s.schema,
                pool_size=s.pool_size,
                handler_pool_size=s.handler_pool_size,
                name=name,
                breaker=Breaker(name) if several else None,
                flushed_starts=s.flushed_starts,
            )
            for name, url in s.urls.items()
        }
        out = {}
        for i, (name, store) in enumerate(stores.items()):
            claimer = Claimer(
                store,
                d.families,
                batch=s.claim_batch,
                caps=caps,
                cap_rule=d.cap_rule,
                is_capped=d.is_capped,
                queued=lambda family: self.queues.queued(family),
                consumers=self.consumers,
                run_stats=RunStats(store),
                database=name,
                primary=i == 0,
                all_stores=list(stores.values()),
            )
            delivery = Delivery(
                store,
                d.registry,
                d.families,
                caps=caps,
                cap_rule=d.cap_rule,
                on_slot_freed=self.request_claim,  # the database the freed slot's release named
                run_times=RunTimes(store),
                database=name,
                primary=i == 0,
            )
            maintenance = Maintenance(store, d.families, s.audit_seconds)
            out[name] = Database(
                name, store.database_url, i == 0, store, claimer, delivery, maintenance
            )
        return out

    def warm_up(self) -> None:
        """A pool process opens its connection pool (in the background) and creates its
        metrics as it starts, so that its first delivery waits for neither."""
        metrics.warm()
        for db in self.dispatcher.databases.values():
            try:
                db.store.pool.get()
            except Exception as exc:  # the first delivery connects (and reports) instead
                event(log, logging.DEBUG, "pool_open_failed", repr(exc))

    def consumers(self) -> int:
        """How many processes consume a family's queue at least: the ``consumers`` setting, or
        this worker's concurrency (the run-time reports add the processes seen delivering)."""
        if self.settings.consumers is not None:
            return self.settings.consumers
        return int(self.dispatcher.app.conf.worker_concurrency or os.cpu_count() or 1)

    def queue_lengths(self) -> dict[str, int]:
        """Messages waiting in each family's broker queue (Flower does not show this); a family
        whose queue the broker cannot report is left out."""
        return self.queues.lengths(self.dispatcher.families.values())

    # -- claim and publish -------------------------------------------------------------------

    def commit_listener(self, database: str | None = None) -> CommitListener:
        """The commit listener of one database (the first by default) that a worker runs
        (claim/listener.py); also usable on its own. It claims that database only."""
        d = self.dispatcher
        db = d.database(database)
        return CommitListener(
            db.url,
            self.settings.schema,
            db.store.channel,
            partial(self.claim_and_publish, database=db.name, refills=True),
            sweep=self.settings.claim_seconds,
            database=d.shown(db),
            trail=d.caps.wake_ms / 1000 if d.caps is not None else None,
        )

    def commit_listeners(self) -> list[CommitListener]:
        """One listener per database: each database's commits wake its own claims."""
        return [self.commit_listener(name) for name in self.dispatcher.databases]

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
        chosen = self.dispatcher.chosen_databases(database)
        if len(chosen) == 1:
            try:
                return self._claim_pass(chosen[0], families, refills=refills)
            except DatabaseUnavailable as exc:  # a restart: said once, the next pass claims
                chosen[0].store.outage.failed("claim pass", str(exc))
                return ClaimReport()
        report = ClaimReport()
        budget = self.settings.claim_seconds / len(chosen)  # the pass fits its interval
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
        with about_database(self.dispatcher.shown(db)):
            publish = partial(self._publish_to, db.name)
            budget = self.settings.claim_seconds if budget is None else budget
            report = db.claimer.run(publish, budget=budget, only=families, refills=refills)
            if report.total:
                event(log, logging.INFO, "claim_pass", f"published {report.claimed}")
        return report

    def _publish_to(self, database: str, family: Family, rows: list[Claimed], size: int) -> None:
        self.publish(family, rows, size, database)

    def publish(
        self, family: Family, rows: Sequence[Claimed], size: int = 1, database: str | None = None
    ) -> None:
        """One message per row, or per ``size`` rows; all on one producer connection. The
        messages name ``database`` unless it is the first."""
        if rows:
            db = self.dispatcher.database(database)
            named = None if db.primary else db.name
            queue = self.dispatcher.queue_name(family.name)
            self.publisher.publish(family, rows, queue, size, named)

    def request_claim(self, family: str, database: str | None = None) -> None:
        """Ask for a claim pass of ``family`` in ``database`` (None: the first) now (a slot
        freed while rows waited for one): a NOTIFY to that database's commit listener, or
        with ``listen=False`` a claim task on the claim queue."""
        d = self.dispatcher
        try:
            db = d.database(database)
            if self.settings.listen:
                db.store.request_claim(family)
            else:
                args = ([family],) if db.primary else ([family], db.name)
                self.claim_task.apply_async(
                    args, queue=d.claim_queue, expires=self.settings.claim_seconds
                )
        except Exception as exc:  # the beat entry claims anyway; a request only speeds it up
            message = f"could not send a claim request: {exc!r}"
            event(log, logging.WARNING, "claim_request_failed", message)

    # -- deliver -------------------------------------------------------------------------------

    def deliver_from_queue(
        self,
        args: tuple[Any, ...],
        routing_key: str | None,
        stop_at: float | None = None,
        first_delivery: bool = False,
    ) -> list[Result]:
        """Run one delivery message (the ``outbox.deliver`` task) against the database it
        names; ``stop_at``: when Celery's soft time limit for it passes (celery/wiring.py);
        ``first_delivery``: the broker did not mark it redelivered."""
        d = self.dispatcher
        prefix = self.settings.queue_prefix + "."
        hint = (
            routing_key[len(prefix) :] if routing_key and routing_key.startswith(prefix) else None
        )
        name, rest = split_message(args)
        db = d.database() if name is None else d.databases.get(name)
        if db is None:  # a forged or foreign name: dropped like any stale message
            shown = repr(name)[:60]
            event(log, logging.WARNING, "stale_dropped", f"message names no database {shown}")
            metrics.outcome(hint, Outcome.STALE.value, "unknown")
            return [Result(Outcome.STALE, None, f"unknown database {shown}")]
        with about_database(d.shown(db)):
            try:
                return db.delivery.deliver_message(
                    rest,
                    family_hint=hint,
                    defer=True,
                    stop_at=stop_at,
                    first_delivery=first_delivery,
                )
            except DatabaseUnavailable as exc:
                # acked without a start: its rows are claimed again after their lease, once the
                # database is back, and this pool process moves on to other databases' rows
                level = logging.INFO if exc.repeated else logging.WARNING
                event(log, level, "stale_dropped", f"{exc}; the message is dropped")
                metrics.outcome(hint, Outcome.STALE.value, db.name)
                return [Result(Outcome.STALE, None, f"database {db.name!r} is down")]

    def task_registration(self, command: str) -> Registration | None:
        """A Celery task of the app, for rows its calls wrote (its handler runs the task)."""
        if command.startswith(tasks.INTERNAL):
            return None
        d = self.dispatcher
        task = d.app.tasks.get(command)  # finalizes the app: only ever at delivery
        if task is None:
            return None
        run = partial(run_task, task, d.queue_name)
        return Registration(command, self.settings.task_family, run, task=True)

    def shown_name(self, family: Family, command: str) -> str:
        """Flower's name for a delivery: ``<family>:<command>``, a task's calls its own name."""
        reg = self.dispatcher.registry.registration(command)
        return command if reg is not None and reg.task else family_command(family, command)
