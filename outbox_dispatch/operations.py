"""What an operator does (``dispatcher.ops``): each family's status, parked rows listed,
retried or purged, retention's prune, and cron schedules. The CLI, the Django admin and the
web page call these, so every one of them keeps ordered lines intact the same way and explains
a row that matched nothing in the same words."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import psycopg

from outbox_dispatch.celery import wiring
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
    InvalidArgument,
    MaintenanceFailed,
    OutboxError,
)
from outbox_dispatch.core.logs import about_database, event
from outbox_dispatch.core.rows import FamilyStatus
from outbox_dispatch.core.validation import encode_payload, row_ids
from outbox_dispatch.databases import Database

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Done:
    """Rows an operation applied to (``ids``), running rows asked to stop (cancel only), and
    why each named row that matched nothing did not."""

    ids: list[int]
    reasons: list[str] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)

    @property
    def missed(self) -> bool:
        return bool(self.reasons)


def why_not(dispatcher: Dispatcher, row_id: int, action: str, database: str | None = None) -> str:
    """Why ``action`` (retry, purge, cancel) matched nothing for a row (of ``database``, the
    first by default), in the operator's terms."""
    state = dispatcher.database(database).store.row_state(row_id)
    if state is None:
        return f"row {row_id} does not exist (delivered rows are deleted unless kept by retention)"
    if state == "parked":
        if action == "cancel":
            return f"row {row_id} is parked: parked rows are purged, not cancelled"
        return f"row {row_id} is parked"
    if state == "cancelled":
        return f"row {row_id} is already cancelled"
    if state == "done":
        return f"row {row_id} was delivered (kept by its family's retention)"
    if action == "cancel":
        return f"row {row_id} was not cancelled: it may already have been asked to stop"
    return f"row {row_id} is not parked: only parked rows can be retried or purged"


def retry_parked(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    family: str | None = None,
    database: str | None = None,
) -> Done:
    """Parked rows (``ids``, or all of ``family``, or all) due again with attempts reset; row
    ids are of ``database`` (required for ids when there are several)."""
    done = dispatcher.ops.parked_retry(ids=ids, family=family, database=database)
    return Done(done, _misses(dispatcher, ids, done, "retry", database))


def purge_parked(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    family: str | None = None,
    database: str | None = None,
) -> Done:
    """Parked rows deleted; an ordered actor whose parked head is gone gets its next row."""
    done = dispatcher.ops.parked_purge(ids=ids, family=family, database=database)
    return Done(done, _misses(dispatcher, ids, done, "purge", database))


def cancel(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    *,
    dedupe_key: str | None = None,
    actor: str | None = None,
    command: str | None = None,
    reason: str | None = None,
    by: str,
    database: str | None = None,
) -> Done:
    """Cancel rows by id, dedupe key or actor in one transaction per database: rows nobody
    delivers are cancelled at once, running ones asked to stop. Ids are of ``database``
    (required for ids when there are several); a key or an actor is looked for in every
    database unless one is named."""
    if ids is not None and not ids and dedupe_key is None and actor is None:
        return Done([], ["no row named"])  # an empty selection cancels nothing, never all
    cancelled: list[int] = []
    requested: list[int] = []
    if ids and database is None and len(dispatcher.databases) > 1:
        return Done([], ["row ids are per database: name the database of the ids"])
    for db in dispatcher.chosen_databases(database):
        with psycopg.connect(db.url) as conn, conn.transaction():
            targets: list[int | None] = list(ids) if ids else [None]
            for row_id in targets:
                result = dispatcher.cancel(
                    conn,
                    row_id,
                    dedupe_key=dedupe_key,
                    actor=actor,
                    command=command,
                    reason=reason,
                    by=by,
                    database=db.name,
                )
                cancelled += result.cancelled
                requested += result.requested
    matched = set(cancelled) | set(requested)
    reasons = [why_not(dispatcher, i, "cancel", database) for i in ids or [] if i not in matched]
    if not matched and not ids:
        reasons.append("no pending or running row matched")
    return Done(cancelled, reasons, requested)


def _misses(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    done: list[int],
    action: str,
    database: str | None = None,
) -> list[str]:
    missing = sorted(set(ids or []) - set(done))
    reasons = [why_not(dispatcher, i, action, database) for i in missing]
    if not done and not reasons:
        reasons.append("no parked row matched")
    return reasons


class Operations:
    """The operator's calls on a Dispatcher, over every database or the one named."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.schedules: dict[str, Schedule] = {}
        self._cron_task = wiring.register_periodic(dispatcher.app, wiring.CRON_TASK, self.run_cron)
        wiring.register_periodic(dispatcher.app, wiring.PRUNE_TASK, self.prune)
        wiring.add_periodic_entry(
            dispatcher.app,
            "outbox-dispatch prune",
            wiring.PRUNE_TASK,
            dispatcher.settings.prune_seconds,
            dispatcher.claim_queue,
        )

    def status(self, database: str | None = None) -> list[FamilyStatus]:
        """Each family's counts in each database (or the one named)."""
        out: list[FamilyStatus] = []
        for db in self.dispatcher.chosen_databases(database):
            out += [replace(s, database=db.name) for s in self._status_of(db)]
        return out

    def _status_of(self, db: Database) -> list[FamilyStatus]:
        d = self.dispatcher
        seen = {s.family: s for s in db.store.status()}
        out = [seen.pop(name, FamilyStatus(name, 0, 0, 0, 0, 0, 0, 0.0)) for name in d.families]
        out += list(seen.values())
        special = [f for f in d.families.values() if f.ordered or d.is_capped(f)]
        if not special:
            return out
        counts, actors = db.store.cap_status([f.name for f in special])
        at_cap: dict[str, int] = {}
        for fam_name, _actor, n in actors:
            fam = d.families[fam_name]
            if d.is_capped(fam) and fam.per_actor is not None and n >= fam.per_actor:
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
        ordered = self.dispatcher.ordered_families()
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
        ordered = self.dispatcher.ordered_families()
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
            for db in self.dispatcher.chosen_databases(database)
            for row in db.store.parked_list(family=family, limit=limit)
        ]

    def _row_databases(self, ids: list[int] | None, database: str | None) -> list[Database]:
        """Row ids mean a row in one database: with several, they need its name."""
        d = self.dispatcher
        if ids and database is None and d.several:
            raise InvalidArgument(
                "row ids are per database and this dispatcher has "
                f"{', '.join(map(repr, d.databases))}: name the database of the ids"
            )
        return d.chosen_databases(database)

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
        d = self.dispatcher
        total: dict[str, int] = {}
        failed: list[str] = []
        for db in d.chosen_databases(database):
            try:
                with about_database(d.shown(db)):
                    part = db.maintenance.prune(
                        batch=batch or d.settings.prune_batch,
                        max_batches=max_batches,
                        progress=progress,
                    )
            except OutboxError as exc:
                if len(d.databases) == 1:
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
        d = self.dispatcher
        if not isinstance(name, str) or not name or len(name) > 100:
            raise ConfigurationError(f"cron name must be a 1-100 character str, got {name!r}")
        try:
            policy = CatchUp(catch_up)
        except ValueError as exc:
            raise ConfigurationError(
                f"catch_up must be 'latest' or 'all', got {catch_up!r}"
            ) from exc
        d.registry.family_of(command)  # the command must be known
        every = real_seconds(check_every)
        if every is None or not (seconds_in(every, 0.0, MAX_INTERVAL) and every > 0):
            raise ConfigurationError(
                f"check_every must be seconds above 0 and at most {MAX_INTERVAL:g}, "
                f"got {check_every!r}"
            )
        schedule = Schedule(name, expr, command, payload, tz, policy, window)
        # a payload that cannot be stored fails here, at declaration, not at every tick
        encode_payload(schedule.payload_for(datetime.now(UTC)), d.settings.payload_limit)
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
                d.app, "outbox-dispatch cron", wiring.CRON_TASK, every, d.claim_queue
            )
        return schedule

    def run_cron(self, now: datetime | None = None) -> dict[str, int]:
        """Write the rows of every schedule's due ticks, in the first database; safe to run
        from several processes."""
        first = self.dispatcher.database()
        enqueue = partial(self.dispatcher.enqueue, database=first.name)
        return first.maintenance.run_cron(self.schedules.values(), enqueue, now)
