"""Handler run times, reported by each delivering process per family and read where claims
are sized (claim/runstats.py)."""

from __future__ import annotations

from outbox_dispatch.store.connections import StoreBase, translated


class RunStatsQueries(StoreBase):
    """Run-time reports (sql/runstats.sql)."""

    def report_run_time(self, family: str, process: str, run_seconds: float) -> None:
        params = {"family": family, "process": process, "run_seconds": run_seconds}
        with translated("run time report"), self._starting() as conn:
            conn.execute(self.q["runstats_report"], params)

    def run_stats(self, max_age: float) -> dict[str, tuple[int, float]]:
        """family -> (processes that reported within ``max_age`` s, their mean run time)."""
        with translated("run time read"), self._starting() as conn:
            rows = conn.execute(self.q["runstats_read"], {"max_age": max_age}).fetchall()
        return {str(r[0]): (int(r[1]), float(r[2])) for r in rows}

    def prune_run_stats(self, max_age: float) -> int:
        with translated("prune"), self._starting() as conn:
            return conn.execute(self.q["runstats_prune"], {"max_age": max_age}).rowcount
