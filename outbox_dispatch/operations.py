"""What an operator does (``dispatcher.ops``): each family's status, parked rows listed,
retried or purged, pause and resume, retention's prune, cron schedules, and the audit log of
those actions. The CLI, the Django admin and the page act through ops/actions.py on top."""

from __future__ import annotations

import getpass
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

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
from outbox_dispatch.core.validation import checked_row_id, encode_payload, row_ids
from outbox_dispatch.databases import Database

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)


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
        paused = {p["family"] for p in db.store.paused()}
        out = [replace(s, paused=s.family in paused) for s in out]
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

    def pause(
        self,
        family: str,
        *,
        reason: str | None = None,
        by: str | None = None,
        database: str | None = None,
    ) -> None:
        """Stop claiming ``family``'s rows in every database (or the one named) until resumed:
        rows already claimed or running finish, enqueues still commit, and the pause holds on
        every worker and across restarts (it is a row in Postgres)."""
        self._family_named(family)
        for what, value in (("reason", reason), ("by", by)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
        for db in self.dispatcher.chosen_databases(database):
            db.store.pause(family, reason, who(by))
        self.audit("pause", {"family": family}, 0, by=by, reason=reason, database=database)

    def resume(self, family: str, *, by: str | None = None, database: str | None = None) -> bool:
        """Claim ``family``'s rows again, at once; False when it was not paused anywhere."""
        self._family_named(family)
        resumed = False
        for db in self.dispatcher.chosen_databases(database):
            if db.store.resume(family):
                resumed = True
                self.dispatcher.runtime.request_claim(family, db.name)
        if resumed:
            self.audit("resume", {"family": family}, 0, by=by, database=database)
        return resumed

    def audit(
        self,
        action: str,
        selection: dict[str, Any],
        rows: int,
        *,
        by: str | None = None,
        reason: str | None = None,
        database: str | None = None,
    ) -> None:
        """Record an operator action (retry, purge, cancel, pause, resume) in the audit log of
        every database it was done in; ``by`` defaults to the OS user, marked as Python."""
        for db in self.dispatcher.chosen_databases(database):
            db.store.audit(who(by), action, selection, rows, reason)

    def audit_log(self, *, limit: int = 50, database: str | None = None) -> list[dict[str, Any]]:
        """The latest operator actions, newest first, of every database (or the one named)."""
        if not count_in(limit, 1, MAX_ROW_ID):
            raise InvalidArgument(f"limit must be a whole number from 1, got {limit!r}")
        rows = [
            {"database": db.name, **row}
            for db in self.dispatcher.chosen_databases(database)
            for row in db.store.audit_list(limit)
        ]
        return sorted(rows, key=lambda r: r["at"], reverse=True)[:limit]

    def paused(self, database: str | None = None) -> list[dict[str, Any]]:
        """Paused families of every database (or the one named), with when, why and who."""
        return [
            {"database": db.name, **row}
            for db in self.dispatcher.chosen_databases(database)
            for row in db.store.paused()
        ]

    def _family_named(self, family: object) -> None:
        if not isinstance(family, str) or family not in self.dispatcher.families:
            known = ", ".join(sorted(self.dispatcher.families))
            raise InvalidArgument(f"no family {family!r}: this dispatcher has {known}")

    def row(self, row_id: int, *, database: str | None = None) -> dict[str, Any] | None:
        """One row with everything an operator reads (its last error and the traceback of
        its last failed attempt among it), or None; row ids are per database."""
        checked_row_id(row_id)
        db = self.dispatcher.database(database)
        found = [r for r in db.store.find_rows(str(row_id), []) if r["id"] == row_id]
        return {"database": db.name, **found[0]} if found else None

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


def who(by: str | None) -> str:
    """Who acted: as given, else the OS user of this process, marked as a Python call."""
    if by:
        return by
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without one)
        user = "unknown"
    return f"{user} (python)"
