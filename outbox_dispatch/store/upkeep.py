"""The statements maintenance (maintenance.py) runs: pruning settled rows and old cancel
requests, and cron schedules' due ticks."""

from __future__ import annotations

from datetime import datetime

from outbox_dispatch.core.cron import Schedule, due_ticks
from outbox_dispatch.store.connections import StoreBase, translated
from outbox_dispatch.store.pool import Conn


class UpkeepQueries(StoreBase):
    """Pruning and cron (sql/maintenance.sql)."""

    def cron_ticks(self, conn: Conn, schedule: Schedule, now: datetime | None) -> list[datetime]:
        """Under the schedule's row lock: the ticks to write, and the schedule advanced to now.
        ``now`` defaults to the database's clock."""
        with translated("cron"):
            if now is None:
                row = conn.execute(self.q["cron_now"]).fetchone()
                assert row is not None
                now = row[0]
            conn.execute(self.q["cron_lock"], {"name": schedule.name, "initial": now})
            found = conn.execute(self.q["cron_last"], {"name": schedule.name}).fetchone()
            assert found is not None
            ticks = due_ticks(
                schedule.expr, schedule.tz, found[0], now, schedule.catch_up, schedule.window
            )
            conn.execute(self.q["cron_advance"], {"name": schedule.name, "tick": now})
        return ticks

    def prune(self, family: str, retention: float, batch: int) -> int:
        with translated("prune"), self._starting() as conn:
            rows = conn.execute(
                self.q["maintenance_prune"],
                {"family": family, "retention": retention, "batch": batch},
            ).fetchall()
        return len(rows)

    def prune_cancel_requests(self) -> int:
        with translated("prune"), self._starting() as conn:
            return len(conn.execute(self.q["maintenance_prune_cancel_requests"]).fetchall())

    def prune_audit(self, retention: float, batch: int) -> int:
        """One batch of the audit log past ``retention`` seconds; how many rows went."""
        params = {"retention": retention, "batch": batch}
        with translated("prune"), self._starting() as conn:
            return len(conn.execute(self.q["maintenance_prune_audit"], params).fetchall())
