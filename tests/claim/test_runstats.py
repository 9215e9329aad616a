"""Run-time reports (runstats.py) against the real Postgres, on a clock the test moves: a
process reports a family's mean at its first run and again soon after (the first run is
often its slowest), then every REPORT_EVERY; a claimer that found no report for a family
reads again after READ_MISSING, not READ_EVERY. Together they let a fresh worker's claims
size its messages from a measured mean within a second."""

from __future__ import annotations

import itertools
import uuid

import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.claim.runstats import (
    READ_EVERY,
    READ_MISSING,
    REPORT_EVERY,
    RunStats,
    RunTimes,
    report_interval,
)

pytestmark = pytest.mark.usefixtures("clean")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_report_intervals_double_from_the_first_up_to_report_every() -> None:
    intervals = [report_interval(n) for n in range(1, 8)]
    assert intervals[0] < 0.5 and intervals[-1] == REPORT_EVERY
    assert all(b == min(REPORT_EVERY, 2 * a) for a, b in itertools.pairwise(intervals))


def test_a_process_reports_its_first_run_at_once_and_the_next_ones_sooner_than_later(
    dispatcher: Dispatcher,
) -> None:
    family = f"rt{uuid.uuid4().hex[:8]}"
    clock = Clock()
    times = RunTimes(dispatcher.store, clock=clock)
    start = clock.now
    stored: list[float | None] = []
    reported_at: list[float] = []
    for step in range(80):  # a run every 50 ms for 4 s, each 1 ms slower than the last
        clock.now = start + step * 0.05
        times.record(family, 0.001 * (step + 1))
        stats = dispatcher.store.run_stats(60).get(family)
        mean = None if stats is None else stats[1]
        if not stored or mean != stored[-1]:
            reported_at.append(round(clock.now - start, 2))
        stored.append(mean)
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(reported_at)]
    assert reported_at[0] == 0.0  # the first run
    assert gaps[:4] == [0.25, 0.5, 1.0, 2.0], reported_at


def test_a_claimer_reads_again_soon_while_a_family_has_no_report(
    dispatcher: Dispatcher,
) -> None:
    family = f"rs{uuid.uuid4().hex[:8]}"
    clock = Clock()
    stats = RunStats(dispatcher.store, clock=clock)
    assert stats.of(family) is None  # nothing reported yet: read, found none
    dispatcher.store.report_run_time(family, "p1", 0.010)
    clock.now += READ_MISSING / 2
    assert stats.of(family) is None  # what was read is kept for a moment
    clock.now += READ_MISSING * 0.6
    assert stats.of(family) == (1, 0.010)  # read again, found
    dispatcher.store.report_run_time(family, "p2", 0.030)
    clock.now += READ_EVERY / 2
    assert stats.of(family) == (1, 0.010)  # a family with a report: READ_EVERY
    clock.now += READ_EVERY * 0.6
    found = stats.of(family)
    assert found is not None and found[0] == 2 and abs(found[1] - 0.020) < 1e-9
