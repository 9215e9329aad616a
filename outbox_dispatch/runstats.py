"""Handler run times, measured where handlers run and read where claims are sized.

Each delivering process keeps a moving mean of its handlers' run time per family and reports
it to Postgres every few seconds (one upsert, off nothing's critical path but the row that
happens to cross the interval). A claimer reads the reports of the last half minute: their
mean run time bounds how many rows one message may carry, and the number of processes that
reported is how many consumers the family has at least.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from .errors import OutboxError
from .forksafe import ForkSafeLock
from .logs import event
from .store import Store

log = logging.getLogger(__name__)

REPORT_EVERY = 2.0  # seconds between one process's reports for a family
MAX_AGE = 30.0  # seconds a report counts for the claimer
READ_EVERY = 1.0  # seconds a claimer reuses what it read
WEIGHT = 0.2  # of the newest run time in the moving mean


class RunTimes:
    """The delivering side: record each handler's run time, report now and then."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._mean: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._lock = ForkSafeLock()

    def record(self, family: str, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            old = self._mean.get(family)
            mean = seconds if old is None else old + WEIGHT * (seconds - old)
            self._mean[family] = mean
            due = now - self._reported.get(family, -REPORT_EVERY) >= REPORT_EVERY
            if due:
                self._reported[family] = now
        if due:
            try:
                self.store.report_run_time(family, _process(), mean)
            except OutboxError as exc:  # sizing falls back to its defaults; nothing is lost
                event(log, logging.DEBUG, "run_time_report_failed", str(exc), family=family)


class RunStats:
    """The claiming side: each family's reported consumers and mean run time, cached."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._stats: dict[str, tuple[int, float]] = {}
        self._read_at = -READ_EVERY

    def of(self, family: str) -> tuple[int, float] | None:
        now = time.monotonic()
        if now - self._read_at >= READ_EVERY:
            self._read_at = now
            try:
                self._stats = self.store.run_stats(MAX_AGE)
            except OutboxError as exc:
                event(log, logging.DEBUG, "run_time_read_failed", str(exc))
        return self._stats.get(family)


def _process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
