"""Handler run times, measured where handlers run and read where claims are sized.

Each delivering process keeps a moving mean of its handlers' run time per family and reports
it to Postgres every few seconds, sooner after its first (one upsert, off nothing's critical
path but the row that happens to cross the interval). A claimer reads the reports of the
last half minute: their mean run time bounds how many rows one message may carry, and the
number of processes that reported is how many consumers the family has at least.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import event
from outbox_dispatch.store import Store

log = logging.getLogger(__name__)

REPORT_EVERY = 2.0  # seconds between one process's reports for a family
REPORT_FIRST = 0.25  # ... after its first report, doubling up to REPORT_EVERY
MAX_AGE = 30.0  # seconds a report counts for the claimer
READ_EVERY = 1.0  # seconds a claimer reuses what it read
READ_MISSING = 0.1  # ... when the family asked for had no report in it
WEIGHT = 0.2  # of the newest run time in the moving mean


def report_interval(reports: int) -> float:
    """Seconds between a process's report number ``reports`` and the next. The first report
    is one run (the process's first, often its slowest: imports, connections), so the next
    ones come sooner: a family's sizing starts from a measured mean within a second of a
    worker's first row, not after REPORT_EVERY."""
    return min(REPORT_EVERY, REPORT_FIRST * 2.0 ** max(0, reports - 1))


class RunTimes:
    """The delivering side: record each handler's run time, report now and then."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._mean: dict[str, float] = {}
        self._reported: dict[str, tuple[float, int]] = {}  # family -> (last report, reports)
        self._lock = ForkSafeLock()

    def record(self, family: str, seconds: float) -> None:
        now = self.clock()
        with self._lock:
            old = self._mean.get(family)
            mean = seconds if old is None else old + WEIGHT * (seconds - old)
            self._mean[family] = mean
            last, reports = self._reported.get(family, (0.0, 0))
            due = reports == 0 or now - last >= report_interval(reports)
            if due:
                self._reported[family] = (now, reports + 1)
        if due:
            try:
                self.store.report_run_time(family, _process(), mean)
            except OutboxError as exc:  # sizing falls back to its defaults; nothing is lost
                event(log, logging.DEBUG, "run_time_report_failed", str(exc), family=family)


class RunStats:
    """The claiming side: each family's reported consumers and mean run time, cached."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._stats: dict[str, tuple[int, float]] = {}
        self._read_at: float | None = None

    def of(self, family: str) -> tuple[int, float] | None:
        """A family's (processes that reported, their mean run time), read again after
        READ_EVERY, or after READ_MISSING while the family has none (a fresh worker's first
        rows report within milliseconds of the claim that found nothing)."""
        now = self.clock()
        again = READ_EVERY if family in self._stats else READ_MISSING
        if self._read_at is None or now - self._read_at >= again:
            self._read_at = now
            try:
                self._stats = self.store.run_stats(MAX_AGE)
            except OutboxError as exc:
                event(log, logging.DEBUG, "run_time_read_failed", str(exc))
        return self._stats.get(family)


def _process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
