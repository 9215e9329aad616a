"""The fault matrix's own figures (tests/chaos/matrix.py), each shown on records made up to
move it: completion against the baseline, settle times and the failover's recovery."""

from __future__ import annotations

from tests.chaos.checks import Enqueued, Final, Run
from tests.chaos.deploy import takeovers
from tests.chaos.matrix import CellResult, completion, settle_times
from tests.chaos.report import Records


def result(cell: str, committed: dict[int, float], settled: dict[int, float]) -> CellResult:
    tail = max(settled.values()) - max(committed.values()) if settled else None
    return CellResult(
        cell=cell,
        fault="",
        faults=0,
        rows=len(committed),
        lost=0,
        unflagged_duplicates=0,
        flagged_duplicates=0,
        cap_breaches=0,
        order_breaches=0,
        settle_limit=20.0,
        fault_to_settled=None,
        settled_after_load=None,
        start_p50=None,
        start_p99=None,
        start_max=None,
        tail=tail,
        peak_sessions=0,
        error_lines=0,
        settle_times=settled,
        committed_at=committed,
    )


def test_completion_counts_rows_settled_within_the_baselines_drain_time() -> None:
    committed = {i: float(i) for i in range(10)}
    baseline = result("baseline", committed, {i: i + 0.5 for i in range(10)})
    assert completion(baseline, baseline) == 100.0
    # the same load, two rows late by a lease: they miss last commit + 0.5 s drain + 1 s slack
    late = {i: i + 0.5 + (10.0 if i in (3, 4) else 0.0) for i in range(10)}
    assert completion(result("cell", committed, late), baseline) == 80.0
    # a row late by less than the slack still counts
    close = {i: i + 0.5 + (0.8 if i == 9 else 0.0) for i in range(10)}
    assert completion(result("cell", committed, close), baseline) == 100.0
    # a baseline that never drained gives no figure
    assert completion(result("cell", committed, late), result("b", committed, {})) is None


def test_a_row_settles_when_its_last_run_ends_and_a_lost_row_never_does() -> None:
    enqueued = [Enqueued(1, "intent", None, False, False), Enqueued(2, "job", None, False, True)]
    runs = [
        Run(1, None, 1, False, 10, 10, started=1.0, ended=1.2, ok=False),
        Run(1, None, 2, False, 10, 10, started=2.0, ended=2.5, ok=True),
        Run(2, None, 1, False, 10, 10, started=1.0, ended=1.1, ok=True),
    ]
    finals = {2: Final(2, "job", None)}  # row 2: still live in the outbox, so not settled
    rec = Records(enqueued, {1: 0.5, 2: 0.5}, finals, runs, {}, [], [], frozenset({"job"}))
    assert settle_times(rec) == {1: 2.5}


def test_failover_recovery_is_the_last_slow_start_after_each_kill() -> None:
    committed = {1: 10.0, 2: 10.5, 3: 11.0, 4: 20.0, 5: 20.5}
    starts = {1: 11.6, 2: 11.6, 3: 11.1, 4: 20.1, 5: 20.6}
    first, second = takeovers([(10.0, "c0", 0.4), (19.0, "c1", None)], committed, starts)
    # rows 1 and 2 waited 1.6 and 1.1 s for the new listener; row 3 was quick: back at +1.6 s
    assert (first.killed, first.rows_after, first.worst_after) == ("c0", 3, 1.6)
    assert first.back_under_1s == 1.6 and first.takeover_seconds == 0.4
    assert (second.back_under_1s, second.takeover_seconds) == (0.0, None)
    # a row that never started: no recovery
    [never] = takeovers([(10.0, "c0", 0.4)], committed, {1: 10.2})
    assert never.back_under_1s is None
