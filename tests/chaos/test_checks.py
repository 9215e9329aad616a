"""The chaos suite's pure checks, each shown to fail on a breach it exists to catch."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import Context, Dispatcher, PermanentFailure
from tests.chaos.checks import (
    GAVE_UP,
    LOST,
    NO_END,
    Closed,
    Enqueued,
    Fate,
    Final,
    Kill,
    Run,
    Span,
    Unfinished,
    Verdict,
    classify,
    close_runs,
    concurrency_breaches,
    delivered_unfinished,
    duplicate_effects,
    order_breaches,
    peak_concurrency,
    percentiles,
    reruns_of_one_claim,
    settle_limit,
    within,
)
from tests.chaos.report import (
    SHOWN_ROWS,
    Facts,
    Fault,
    Records,
    assess,
    row_state,
    state_of,
    unsettled_lines,
)
from tests.chaos.workload import (
    FAMILIES,
    declare_families,
    policies,
    polite_work,
    time_limit_of,
)


def run(
    row: int,
    start: float,
    end: float | None,
    *,
    actor: str | None = "a",
    attempt: int = 1,
    ok: bool | None = True,
    pid: int = 100,
    pgid: int = 10,
    told: bool = False,
) -> Run:
    return Run(row, actor, attempt, False, pid, pgid, start, end, ok, told)


def span(row: int, start: float, end: float, actor: str | None = "a", told: bool = False) -> Span:
    return Span(row, actor, start, end, Closed.RECORDED, told)


# -- closing runs that never recorded an end ---------------------------------------------------


def test_a_recorded_end_is_kept() -> None:
    [s] = close_runs([run(1, 1.0, 2.0)], [Kill(1.5, pgid=10)], lease=5)
    assert (s.end, s.closed) == (2.0, Closed.RECORDED)


def test_a_killed_run_ends_at_the_first_kill_of_its_process_group_after_it_started() -> None:
    kills = [Kill(0.5, pgid=10), Kill(3.0, pgid=99), Kill(4.0, pgid=10), Kill(6.0, pgid=10)]
    [s] = close_runs([run(1, 1.0, None)], kills, lease=30)
    assert (s.end, s.closed) == (4.0, Closed.KILLED)


def test_a_killed_pool_process_ends_the_runs_of_that_pid_only() -> None:
    spans = close_runs(
        [run(1, 1.0, None, pid=101), run(2, 1.0, None, pid=102)], [Kill(2.0, pid=101)], lease=7
    )
    assert [(s.row_id, s.end, s.closed) for s in spans] == [
        (1, 2.0, Closed.KILLED),
        (2, 8.0, Closed.ASSUMED),  # no end, no kill: a whole lease, the strict assumption
    ]


# -- caps: the overlap sweep -------------------------------------------------------------------


def test_three_overlapping_runs_of_one_actor_breach_a_cap_of_two() -> None:
    spans = [span(1, 0, 10), span(2, 1, 10), span(3, 2, 3), span(4, 20, 21)]
    [b] = concurrency_breaches(spans, cap=2)
    assert (b.actor, b.at, b.level, b.rows, b.stale_run) == ("a", 2, 3, (1, 2, 3), False)
    assert peak_concurrency(spans) == {"a": 3}


def test_a_slot_freed_and_taken_at_the_same_instant_is_not_an_overlap() -> None:
    spans = [span(1, 0, 5), span(2, 0, 5), span(3, 5, 9)]
    assert concurrency_breaches(spans, cap=2) == []
    assert peak_concurrency(spans) == {"a": 2}


def test_caps_are_per_actor_and_rows_without_an_actor_are_not_capped() -> None:
    spans = [span(1, 0, 5, "a"), span(2, 0, 5, "a"), span(3, 0, 5, "b"), span(4, 0, 5, "b")]
    spans += [span(5, 0, 5, None), span(6, 0, 5, None), span(7, 0, 5, None)]
    assert concurrency_breaches(spans, cap=2) == []


def test_each_episode_above_the_cap_is_one_breach() -> None:
    spans = [span(1, 0, 4), span(2, 1, 4), span(3, 2, 4), span(4, 3, 4)]  # 3 then 4 at once
    spans += [span(5, 10, 12), span(6, 10, 12), span(7, 11, 12)]
    breaches = concurrency_breaches(spans, cap=2)
    assert [(b.at, b.level) for b in breaches] == [(2, 3), (11, 3)]


def test_a_run_killed_before_the_next_ones_started_does_not_overlap_them() -> None:
    runs = [run(1, 0.0, None), run(2, 6.0, 7.0), run(3, 6.0, 7.0)]
    assert concurrency_breaches(close_runs(runs, [Kill(5.0, pgid=10)], lease=30), cap=2) == []
    # without the kill on record it is assumed to run a whole lease, and the check says so
    assert len(concurrency_breaches(close_runs(runs, [], lease=30), cap=2)) == 1


def test_a_breach_involving_a_run_told_to_stop_is_marked_stale() -> None:
    spans = [span(1, 0, 9, told=True), span(2, 1, 5), span(3, 2, 5)]
    [b] = concurrency_breaches(spans, cap=2)
    assert b.stale_run


@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 10), st.sampled_from(["a", "b"])),
        max_size=25,
    ),
    st.integers(1, 4),
)
def test_the_sweep_agrees_with_counting_at_every_start(
    raw: list[tuple[int, int, str]], cap: int
) -> None:
    spans = [span(i, s, s + d, actor) for i, (s, d, actor) in enumerate(raw)]
    brute: dict[str, int] = {}
    for s in spans:
        at_start = sum(1 for o in spans if o.actor == s.actor and o.start <= s.start < o.end)
        brute[s.actor or ""] = max(brute.get(s.actor or "", 0), at_start)
    assert peak_concurrency(spans) == brute
    breached = {b.actor for b in concurrency_breaches(spans, cap)}
    assert breached == {a for a, peak in brute.items() if peak > cap}


# -- ordered families --------------------------------------------------------------------------


def test_rows_that_run_one_after_another_in_order_pass() -> None:
    spans = [span(1, 0, 1), span(1, 2, 3), span(2, 3, 4), span(3, 5, 6)]  # row 1 retried
    assert order_breaches({"a": [1, 2, 3]}, spans, succeeded={1, 2, 3}) == []


def test_a_row_that_starts_before_the_row_before_it_ended_is_a_breach() -> None:
    spans = [span(1, 0, 5), span(2, 4, 6)]
    [b] = order_breaches({"a": [1, 2]}, spans, succeeded={1, 2})
    assert (b.earlier, b.later) == (1, 2)
    assert "before the row before ended" in b.why


def test_a_row_that_overtakes_a_row_still_waiting_is_a_breach() -> None:
    spans = [span(2, 0, 1), span(1, 2, 3)]  # enqueue order 1, 2; ran 2 first
    [b] = order_breaches({"a": [1, 2]}, spans, succeeded={1, 2})
    assert (b.earlier, b.later) == (1, 2)


def test_a_row_that_runs_although_the_row_before_never_succeeded_is_a_breach() -> None:
    spans = [span(1, 0, 1), span(2, 2, 3)]
    [b] = order_breaches({"a": [1, 2]}, spans, succeeded={2})
    assert "never succeeded" in b.why
    # a later row that never ran behind a row that never succeeded is what should happen
    assert order_breaches({"a": [1, 2]}, [span(1, 0, 1)], succeeded=set()) == []


# -- duplicate effects -------------------------------------------------------------------------


def test_one_effect_per_row_is_no_duplicate() -> None:
    d = duplicate_effects([(1, 1, False), (2, 3, True)])
    assert (d.rows, d.extra, d.flagged, d.unflagged) == (0, 0, 0, 0)


def test_a_repeat_told_maybe_applied_is_a_flagged_duplicate() -> None:
    d = duplicate_effects([(1, 2, True), (1, 1, False)])
    assert (d.rows, d.extra, d.flagged, d.unflagged) == (1, 1, 1, 0)


def test_a_repeat_not_told_is_an_unflagged_duplicate() -> None:
    d = duplicate_effects([(1, 1, False), (1, 2, False), (2, 1, False), (2, 2, True)])
    assert (d.extra, d.flagged, d.unflagged, d.unflagged_rows) == (2, 1, 1, (1,))


def test_two_runs_of_one_attempt_are_one_claim_run_twice() -> None:
    runs = [run(1, 0, 1, attempt=1), run(1, 2, 3, attempt=2), run(2, 0, 1), run(2, 5, 6)]
    assert reruns_of_one_claim(runs) == [(2, 1)]


# -- what became of each row -------------------------------------------------------------------


def test_fates_of_settled_rows() -> None:
    enq = [
        Enqueued(1, "intent", None, False, False),  # deleted after a successful run
        Enqueued(2, "job", None, False, True),  # kept as done, effect committed
        Enqueued(3, "intent", None, True, False),  # planned PermanentFailure
        Enqueued(4, "capped", "x", False, False),  # parked after repeated lost attempts
    ]
    finals = {
        2: Final(2, "job", None, done=True),
        3: Final(3, "intent", None, parked=True, last_error="errors.PermanentFailure: planned"),
        4: Final(4, "capped", "x", parked=True, last_error="attempt 5 ended without an outcome"),
    }
    fates = classify(enq, finals, succeeded={1, 2})
    assert fates == {
        1: Fate.DONE,
        2: Fate.DONE,
        3: Fate.PARKED_EXPECTED,
        4: Fate.PARKED_LOST,
    }
    assert not set(fates.values()) & LOST


def test_fates_that_count_as_lost() -> None:
    enq = [
        Enqueued(1, "intent", None, False, False),  # deleted, but no run ever succeeded
        Enqueued(2, "job", None, False, True),  # gone from a family that keeps done rows
        Enqueued(3, "job", None, False, True),  # marked done without its effect
        Enqueued(4, "intent", None, False, False),  # still due at the end
        Enqueued(5, "ordered", "l", False, False),  # blocked, and its head is not parked
        Enqueued(6, "ordered", "l", False, False),
    ]
    finals = {
        3: Final(3, "job", None, done=True),
        4: Final(4, "intent", None),
        5: Final(5, "ordered", "l"),
        6: Final(6, "ordered", "l", blocked=True),
    }
    fates = classify(enq, finals, succeeded=set())
    assert fates == {
        1: Fate.NO_EFFECT,
        2: Fate.VANISHED,
        3: Fate.NO_EFFECT,
        4: Fate.LIVE,
        5: Fate.LIVE,
        6: Fate.LIVE,
    }
    assert set(fates.values()) <= LOST


def test_rows_behind_a_parked_ordered_head_are_held_not_lost() -> None:
    enq = [
        Enqueued(1, "ordered", "l", False, False),
        Enqueued(2, "ordered", "l", False, False),
        Enqueued(3, "intent", None, True, False),
        Enqueued(4, "intent", None, False, False),
    ]
    finals = {
        1: Final(1, "ordered", "l", parked=True, last_error="attempt 5 ended without an outcome"),
        2: Final(2, "ordered", "l", blocked=True),
        3: Final(3, "intent", None, parked=True, last_error="RuntimeError: not planned"),
        4: Final(4, "intent", None, cancelled=True),
    }
    fates = classify(enq, finals, succeeded=set())
    assert fates == {
        1: Fate.PARKED_LOST,
        2: Fate.HELD,
        3: Fate.PARKED_OTHER,
        4: Fate.CANCELLED,
    }


def test_settle_time_within_a_limit() -> None:
    assert within(7.5, 10.0)
    assert not within(10.5, 10.0)
    assert not within(None, 10.0)  # never settled


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values, (50, 99, 100)) == {"50": 50.0, "99": 99.0, "100": 100.0}
    assert percentiles([3.0], (50, 99)) == {"50": 3.0, "99": 3.0}
    assert percentiles([], (50,)) == {}


# -- attempts that delivered a row without doing its work --------------------------------------


def test_a_row_delivered_by_an_attempt_that_gave_up_on_is_cancelled_is_found() -> None:
    runs = [
        Run(1, None, 1, False, 100, 10, 0.0, 2.0, False, True, gave_up=True),
        Run(2, None, 1, False, 100, 10, 0.0, 2.0, False, True, gave_up=True),
        Run(2, None, 2, False, 100, 10, 3.0, 3.1, True),  # retried, then done: fine
        Run(3, None, 1, False, 100, 10, 0.0, 2.0, False, True, gave_up=True),  # not delivered
        Run(4, None, 1, False, 100, 10, 0.0, 1.0, True),
    ]
    found = delivered_unfinished(runs, delivered={1, 2, 4})
    assert found == [Unfinished(1, 1, GAVE_UP)]


def test_a_row_delivered_by_a_run_that_raised_or_never_returned_is_found() -> None:
    runs = [
        Run(1, None, 1, False, 100, 10, 0.0, 1.0, False, error="SoftTimeLimitExceeded"),
        Run(2, None, 1, False, 100, 10, 0.0, None, None),
        Run(3, None, 1, False, 100, 10, 0.0, None, None),  # killed; the rerun settled it
        Run(3, None, 2, True, 100, 10, 6.0, 6.1, True),
    ]
    found = delivered_unfinished(runs, delivered={1, 2, 3})
    assert found == [Unfinished(1, 1, "raised SoftTimeLimitExceeded"), Unfinished(2, 1, NO_END)]


def test_the_settling_attempt_is_the_last_to_start_whatever_the_order_of_the_records() -> None:
    late_ok = Run(1, None, 2, True, 100, 10, 5.0, 5.2, True)
    early_gave_up = Run(1, None, 1, False, 100, 10, 1.0, 3.0, False, True, gave_up=True)
    assert delivered_unfinished([late_ok, early_gave_up], {1}) == []
    # the other way round: the attempt that settled it is the one that gave up
    late_gave_up = Run(1, None, 2, False, 100, 10, 5.0, 7.0, False, True, gave_up=True)
    early_ok = Run(1, None, 1, False, 100, 10, 1.0, 1.2, True)
    assert delivered_unfinished([late_gave_up, early_ok], {1}) == [Unfinished(1, 2, GAVE_UP)]


# -- the settle limit ----------------------------------------------------------------------------


def test_the_settle_limit_is_two_of_the_longest_lease_or_heartbeat_timeout() -> None:
    assert settle_limit([(5.0, None), (10.0, None)]) == 20.0
    assert settle_limit([(5.0, 30.0), (10.0, 8.0)]) == 60.0
    assert settle_limit([(5.0, 3.0)]) == 10.0  # a timeout below the lease: the lease decides
    with pytest.raises(ValueError, match="at least one family"):
        settle_limit([])


def _dispatcher(cls: type[Dispatcher] = Dispatcher) -> Dispatcher:
    app = Celery("unit", broker="memory://", set_as_current=False)
    return cls(app, database_url="postgresql://u@127.0.0.1:1/db", redis_url="redis://x:1/0")


def test_policies_read_the_families_as_the_core_holds_them() -> None:
    d = _dispatcher()
    declare_families(d, lease=4.0, heartbeat_timeout=6.0)
    assert policies(d) == [(4.0, 6.0)] * len(FAMILIES)
    assert settle_limit(policies(d)) == 12.0
    assert d.families["trickle"].max_in_flight == 2
    assert d.families["limited"].time_limit == time_limit_of(4.0)
    declare_families(d, lease=5.0)  # no timeout given: the lease
    assert policies(d) == [(5.0, 5.0)] * len(FAMILIES)


# -- a polite handler's own view of how it ended -----------------------------------------------


def _ctx(attempt: int = 1) -> Context:
    return Context(1, "limited", "chaos.limited", None, attempt, "k", False)


def test_a_polite_handler_told_to_stop_returns_without_its_effect() -> None:
    effects: list[int] = []
    ctx = _ctx()
    ctx.cancelled.set()
    assert polite_work(ctx, {"ms": 10_000}, lambda c: effects.append(c.attempt))
    assert effects == []


def test_a_polite_handler_that_is_not_told_does_its_work() -> None:
    effects: list[int] = []
    assert not polite_work(_ctx(), {"ms": 1}, lambda c: effects.append(c.attempt))
    assert effects == [1]
    with pytest.raises(PermanentFailure):
        polite_work(_ctx(), {"ms": 1, "permanent": True}, lambda c: effects.append(0))
    assert effects == [1]


def test_an_overrunning_attempt_runs_its_long_time_and_stops_when_told() -> None:
    ctx = _ctx(attempt=1)
    threading.Timer(0.15, ctx.cancelled.set).start()
    t0 = time.monotonic()
    assert polite_work(ctx, {"ms": 1, "overrun": 1, "over_ms": 5000}, lambda c: None)
    assert 0.1 < time.monotonic() - t0 < 1.0  # stopped in a step or two, not after 5 s
    # the attempt after the overrun is quick
    t0 = time.monotonic()
    assert not polite_work(
        _ctx(attempt=2), {"ms": 1, "overrun": 1, "over_ms": 5000}, lambda c: None
    )
    assert time.monotonic() - t0 < 0.5


# -- the printed state of a row that did not settle --------------------------------------------


def test_a_row_state_prints_times_from_the_last_fault_and_leads_with_the_key_columns() -> None:
    origin = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    raw = {
        "created_at": "2026-01-01T11:59:50+00:00",
        "payload": {"big": "x" * 100},
        "trace_context": None,
        "id": 7,
        "family": "trickle",
        "started_at": "2026-01-01T11:59:57.5+00:00",
        "due_at": "infinity",
        "claim_token": "14cff8d9-e9b0-4f9c-9eeb-c37779b85354",
        "waiting": False,
        "parked_at": None,
    }
    state = state_of(raw, origin)
    assert "payload" not in state
    assert "trace_context" not in state
    assert state["started_at"].endswith("(-2.5 s)")
    assert state["due_at"] == "infinity"
    assert (state["waiting"], state["parked_at"]) == ("false", "null")
    line = row_state(state)
    assert line.startswith("id=7 family=trickle claim_token=14cff8d9")
    assert line.index("started_at=") < line.index("due_at=") < line.index("created_at=")


def test_at_most_the_shown_rows_are_printed_and_the_rest_counted() -> None:
    rows = [{"id": str(i), "runs": "never ran"} for i in range(SHOWN_ROWS + 5)]
    lines = unsettled_lines(rows, count=100)
    assert lines[0] == "rows not settled within the settle limit: 100"
    assert sum(1 for line in lines if line.startswith("  id=")) == SHOWN_ROWS
    assert lines[-1] == f"  ... and {100 - SHOWN_ROWS} more"
    assert unsettled_lines([], count=0) == []


# -- the verdicts a run's records lead to ------------------------------------------------------


def _assess(*, unsettled: int = 0, settled_at: float | None = 105.0) -> dict[str, Verdict]:
    records = Records(
        enqueued=[
            Enqueued(1, "limited", None, False, False),
            Enqueued(2, "intent", None, False, False),
        ],
        committed_at={1: 90.0, 2: 90.0},
        finals={},  # both deleted: delivered
        runs=[
            Run(1, None, 1, False, 100, 10, 95.0, 97.0, False, True, gave_up=True),
            Run(2, None, 1, False, 100, 10, 95.0, 95.1, True),
        ],
        run_family={1: "limited", 2: "intent"},
        plain_effects=[(2, 1, False)],
        txn_effects=[],
        transactional=frozenset({"job"}),
    )
    facts = Facts(
        config={"lease": 5.0},
        logdir="",
        fault_kinds=("kill -9 worker",),
        faults=[Fault(1.0, 100.0, "kill -9 worker", "w0")],
        kills=[],
        crashes=[],
        planned=2,
        enqueued=2,
        producer_retries=0,
        first_commit_at=90.0,
        live_at_last_fault=0,
        stranded_by_last_fault=0,
        settled_at=settled_at,
        now=120.0,
        settle_limit=10.0,
        unsettled=[{"id": "1"}][:unsettled],
        unsettled_count=unsettled,
    )
    return {v.name.split(" (")[0]: v for v in assess(records, facts).verdicts}


def test_a_delivered_row_whose_handler_gave_up_fails_the_run_and_says_why() -> None:
    verdicts = _assess()
    unfinished = verdicts[
        "delivered by an attempt that gave up on is_cancelled, failed or never returned"
    ]
    assert not unfinished.ok
    assert unfinished.value == f"1 (1 {GAVE_UP})"
    assert not verdicts["rows lost"].ok  # and it is lost: its work was never done
    assert verdicts["settle after the last fault"].ok  # 5 s after the fault, limit 10 s


def test_rows_unsettled_at_the_limit_fail_the_run_even_if_they_settle_later() -> None:
    late = _assess(unsettled=3, settled_at=125.0)["settle after the last fault"]
    assert not late.ok
    assert late.value == "3 rows unsettled at +10 s (all settled after 25.0 s)"
    stuck = _assess(unsettled=3, settled_at=None)["settle after the last fault"]
    assert (stuck.ok, stuck.value) == (False, "3 rows unsettled at +10 s (never settled)")
