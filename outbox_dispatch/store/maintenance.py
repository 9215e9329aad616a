"""Maintenance, run by beat: prune settled rows past their family's retention, repair ordered
lines a crash left without a head, release rows blocked in a family that is no longer
ordered, clean up cancel requests, and write cron schedules' rows. Each family is maintained on
its own, so one family's failure never stops the others'."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from outbox_dispatch.core.cron import Schedule
from outbox_dispatch.core.errors import DatabaseUnavailable, MaintenanceFailed, OutboxError
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import Family
from outbox_dispatch.store import Store

log = logging.getLogger(__name__)


RUN_STATS_KEPT = 3600.0  # seconds a quiet process's run-time report is kept
AUDIT_KEPT = 90 * 86400.0  # seconds an operator action stays in the audit log, by default


class Maintenance:
    def __init__(
        self, store: Store, families: Mapping[str, Family], audit_retention: float = AUDIT_KEPT
    ) -> None:
        self.store = store
        self.families = families
        self.audit_retention = audit_retention

    def prune(
        self,
        *,
        batch: int,
        max_batches: int = 100,
        progress: Callable[[str, int], None] | None = None,
    ) -> dict[str, int]:
        """Delete delivered and cancelled rows past their family's retention, in batches of
        ``batch`` rows (short transactions, never one long lock); ``progress(family, deleted so
        far)`` is called after each batch that deleted something."""
        size = batch
        deleted: dict[str, int] = {}
        failed: list[str] = []
        for fam in list(self.families.values()):
            try:  # one family's failure must not stop the others' maintenance
                total = self._maintain(fam, size, max_batches, progress)
            except DatabaseUnavailable as exc:  # a restart: said once, the next pass prunes
                self.store.outage.failed("maintenance", str(exc))
                return deleted
            except OutboxError as exc:
                failed.append(fam.name)
                event(
                    log,
                    logging.ERROR,
                    "maintenance_failed",
                    f"{exc}; the other families are maintained, this one is tried next pass",
                    family=fam.name,
                )
                continue
            if total:
                deleted[fam.name] = total
        try:
            self.store.prune_cancel_requests()
            self.store.prune_run_stats(RUN_STATS_KEPT)
            for _ in range(max_batches):  # the audit log, batch by batch
                if self.store.prune_audit(self.audit_retention, size) < size:
                    break
        except OutboxError as exc:
            failed.append("cancel requests and audit log")
            event(
                log, logging.ERROR, "maintenance_failed", f"cancel request or audit cleanup: {exc}"
            )
        if failed:
            raise MaintenanceFailed(
                f"maintenance failed for {', '.join(failed)} (the others were done): see the "
                "log's maintenance_failed events"
            )
        return deleted

    def _maintain(
        self,
        fam: Family,
        size: int,
        max_batches: int,
        progress: Callable[[str, int], None] | None,
    ) -> int:
        """One family's pass: prune past retention, repair ordered lines a crash left without
        a head, and let blocked rows of a family that is no longer ordered go."""
        total = 0
        for _ in range(max_batches if math.isfinite(fam.retention) else 0):
            n = self.store.prune(fam.name, fam.retention, size)
            total += n
            if n and progress is not None:
                progress(fam.name, total)
            if n < size:
                break
        if total:
            event(log, logging.INFO, "pruned", f"{total} settled rows", family=fam.name)
        if fam.ordered:
            promoted = self.store.sweep_heads(fam.name, fam.parked_blocks)
            if promoted:
                event(
                    log,
                    logging.WARNING,
                    "heads_repaired",
                    f"{len(promoted)} ordered actors had no head",
                    family=fam.name,
                )
        else:
            released = self.store.unblock(fam.name, size)
            if released:
                event(
                    log,
                    logging.WARNING,
                    "unblocked",
                    f"{released} rows were blocked behind an ordered head, but the family is "
                    "not ordered any more: they are due",
                    family=fam.name,
                )
        return total

    def run_cron(
        self,
        schedules: Iterable[Schedule],
        enqueue: Callable[..., int],
        now: datetime | None = None,
    ) -> dict[str, int]:
        """Write the rows of every schedule's due ticks; safe to run from several processes."""
        written: dict[str, int] = {}
        failed: list[str] = []
        for schedule in list(schedules):
            try:
                with self.store.connection() as conn, conn.transaction():
                    ticks = self.store.cron_ticks(conn, schedule, now)
                    for tick in ticks:
                        enqueue(
                            conn,
                            schedule.command,
                            schedule.payload_for(tick),
                            dedupe_key=schedule.dedupe_key(tick),
                            at=tick,
                        )
            except Exception as exc:  # one schedule's failure must not stop the others' ticks
                event(
                    log,
                    logging.ERROR,
                    "cron_failed",
                    f"schedule {schedule.name!r} wrote no tick ({exc!r}); its ticks are "
                    "written by the next pass that succeeds, as its catch_up says",
                    command=schedule.command,
                )
                failed.append(schedule.name)
                continue
            if ticks:
                written[schedule.name] = len(ticks)
                event(
                    log,
                    logging.INFO,
                    "cron",
                    f"{len(ticks)} ticks written for {schedule.name}",
                    command=schedule.command,
                )
        if failed:  # as prune does: the others' ticks are written, and the pass says which failed
            raise MaintenanceFailed(
                f"cron failed for {', '.join(failed)} (the others' ticks were written): see the "
                "log's cron_failed events"
            )
        return written
