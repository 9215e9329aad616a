"""Property-based tests of the pure decisions that test_policy and test_capped_plan leave open:
cron ticks (catch-up, windows, time zones, pass after pass), backoff growth, the park verdict,
and the capped pick's per-actor fairness."""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter  # type: ignore[import-untyped]
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from outbox_dispatch import Backoff, Family
from outbox_dispatch.core.bounds import MAX_BACKOFF
from outbox_dispatch.core.cron import MAX_TICKS, CatchUp, due_ticks
from outbox_dispatch.core.policy import (
    Candidate,
    CapRule,
    Verdict,
    decide_failure,
    plan_capped_claim,
)

# -- cron ---------------------------------------------------------------------------------------

# expression -> the longest gap between two passes we try (so a case stays a few hundred ticks)
EXPRESSIONS = {
    "* * * * * *": timedelta(minutes=5),  # every second (six fields: seconds last)
    "*/10 * * * * *": timedelta(minutes=30),
    "* * * * *": timedelta(hours=5),
    "*/15 * * * *": timedelta(days=2),
    "0 * * * *": timedelta(days=10),
    "30 2 * * *": timedelta(days=200),  # inside the hour that DST skips or repeats
    "0 9 * * 1-5": timedelta(days=200),
    "0 0 1 * *": timedelta(days=800),
    "0 0 29 2 *": timedelta(days=3000),  # leap days only
}
ZONES = ["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe"]
# instants near DST changes (Lord Howe moves by 30 minutes), where tick arithmetic goes wrong
DST_EDGES = [
    datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
    datetime(2026, 10, 25, 1, 0, tzinfo=UTC),
    datetime(2026, 3, 8, 7, 0, tzinfo=UTC),
    datetime(2026, 11, 1, 6, 0, tzinfo=UTC),
    datetime(2026, 4, 4, 15, 0, tzinfo=UTC),
    datetime(2026, 10, 3, 15, 30, tzinfo=UTC),
]


@st.composite
def cron_cases(draw: st.DrawFn) -> tuple[str, str, datetime, datetime, timedelta]:
    expr = draw(st.sampled_from(sorted(EXPRESSIONS)))
    tz = draw(st.sampled_from(ZONES))
    longest = EXPRESSIONS[expr]
    start = draw(
        st.one_of(
            st.datetimes(datetime(2024, 1, 1), datetime(2028, 12, 31), timezones=st.just(UTC)),
            st.builds(
                lambda edge, offset: edge + offset,
                st.sampled_from(DST_EDGES),
                st.timedeltas(-min(longest, timedelta(days=2)), timedelta(0)),
            ),
        )
    )
    gap = draw(st.timedeltas(timedelta(0), longest))
    window = draw(st.one_of(st.timedeltas(timedelta(seconds=1), longest), st.just(longest * 2)))
    return expr, tz, start, start + gap, window


def _next(expr: str, tz: str, after: datetime) -> datetime:
    tick: datetime = croniter(expr, after.astimezone(ZoneInfo(tz))).get_next(datetime)
    return tick


@settings(max_examples=150, deadline=None)
@given(cron_cases())
@example(  # `last` between the two 02:30s of the day the clock goes back: no run that day
    ("30 2 * * *", "Europe/Paris", datetime(2026, 10, 25, 1, 0, tzinfo=UTC),
     datetime(2026, 10, 26, 1, 0, tzinfo=UTC), timedelta(days=400))
)  # fmt: skip
def test_all_ticks_are_increasing_due_within_the_window_and_none_is_skipped(
    case: tuple[str, str, datetime, datetime, timedelta],
) -> None:
    expr, tz, last, now, window = case
    ticks = due_ticks(expr, tz, last, now, CatchUp.ALL, window)
    utc = [t.astimezone(UTC) for t in ticks]
    assert all(t.tzinfo is not None for t in ticks)
    assert all(a < b for a, b in itertools.pairwise(utc)), "not strictly increasing"
    assert all(last < t <= now for t in utc), "a tick outside (last, now]: already run or future"
    assert all(t > now - window for t in utc), "a tick older than the catch-up window"
    assert len(ticks) <= MAX_TICKS
    # complete: from the window's start, every tick of the schedule up to now, in order; a
    # schedule with fixed hours never runs at the repeat of a wall-clock time (beat advances
    # `last` to each pass's time, so a repeat after `last` may follow a first run before it)
    start = max(last, now - window)
    fixed_hours = "*" not in expr.split()[1]
    expected: list[datetime] = []
    tick = _next(expr, tz, start)
    while tick.astimezone(UTC) <= now and len(expected) <= MAX_TICKS:
        if not (fixed_hours and tick.fold):
            expected.append(tick.astimezone(UTC))
        tick = _next(expr, tz, tick)
    assert utc == expected[-MAX_TICKS:]


@settings(max_examples=150, deadline=None)
@given(cron_cases())
def test_latest_is_the_newest_of_all_the_missed_ticks(
    case: tuple[str, str, datetime, datetime, timedelta],
) -> None:
    expr, tz, last, now, _ = case
    every = due_ticks(expr, tz, last, now, CatchUp.ALL, now - last + timedelta(days=1))
    latest = due_ticks(expr, tz, last, now, CatchUp.LATEST, timedelta(seconds=1))
    assert len(latest) <= 1
    assert [t.astimezone(UTC) for t in latest] == [t.astimezone(UTC) for t in every[-1:]]


@settings(max_examples=150, deadline=None)
@given(cron_cases(), st.floats(0, 1))
def test_pass_after_pass_writes_each_tick_once(
    case: tuple[str, str, datetime, datetime, timedelta], split: float
) -> None:
    """Beat advances the schedule to each pass's now: two passes write what one pass over the
    whole span writes, no tick lost between them and none written twice."""
    expr, tz, last, now, _ = case
    mid = last + (now - last) * split
    assume(last <= mid <= now)
    wide = now - last + timedelta(days=1)
    one = due_ticks(expr, tz, last, now, CatchUp.ALL, wide)
    two = due_ticks(expr, tz, last, mid, CatchUp.ALL, wide) + due_ticks(
        expr, tz, mid, now, CatchUp.ALL, wide
    )
    assume(len(one) < MAX_TICKS)
    assert [t.astimezone(UTC) for t in two] == [t.astimezone(UTC) for t in one]


@settings(max_examples=100, deadline=None)
@given(
    expr=st.sampled_from(sorted(EXPRESSIONS)),
    tz=st.sampled_from(ZONES),
    now=st.datetimes(datetime(2024, 1, 1), datetime(2028, 12, 31), timezones=st.just(UTC)),
)
def test_nothing_is_due_twice_or_from_the_future(expr: str, tz: str, now: datetime) -> None:
    for policy in CatchUp:
        assert due_ticks(expr, tz, now, now, policy, timedelta(days=365)) == []
        future = due_ticks(expr, tz, now + timedelta(days=1), now, policy, timedelta(days=365))
        assert future == []  # a schedule whose last tick is ahead of the clock waits


@pytest.mark.parametrize("policy", list(CatchUp))
def test_a_daily_schedule_runs_once_on_the_day_the_clock_goes_back(policy: CatchUp) -> None:
    day_before = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    written = []
    now = day_before
    while now < day_before + timedelta(days=1):  # beat: a pass every 10 minutes for a day
        later = now + timedelta(minutes=10)
        written += due_ticks("30 2 * * *", "Europe/Paris", now, later, policy, timedelta(hours=1))
        now = later
    assert len(written) == 1, [t.astimezone(UTC).isoformat() for t in written]


# -- backoff and the park verdict ---------------------------------------------------------------


@given(
    base=st.floats(0.001, 100),
    factor=st.floats(1, 1e6),
    jitter=st.floats(0, 1),
    rand=st.floats(0, 1, exclude_max=True),
    attempts=st.integers(-3, 200),
)
def test_backoff_never_shrinks_from_one_attempt_to_the_next_and_at_most_doubles(
    base: float, factor: float, jitter: float, rand: float, attempts: int
) -> None:
    b = Backoff(base=base, cap=min(base * factor, MAX_BACKOFF), jitter=jitter)
    now, after = b.delay(attempts, rand), b.delay(attempts + 1, rand)
    assert now <= after <= 2 * now * (1 + 1e-12)
    assert after <= b.cap
    assert b.delay(attempts, 0.0) == min(b.cap, base * 2.0 ** (max(attempts, 1) - 1))


@given(
    max_attempts=st.none() | st.integers(1, 50),
    attempts=st.integers(0, 100),
    rand=st.floats(0, 1, exclude_max=True),
    permanent=st.booleans(),
)
def test_park_verdict(
    max_attempts: int | None, attempts: int, rand: float, permanent: bool
) -> None:
    family = Family("f", max_attempts=max_attempts, backoff=Backoff(0.5, 60, 0.3))
    decision = decide_failure(family, attempts, rand, permanent=permanent)
    exhausted = max_attempts is not None and attempts >= max_attempts
    assert (decision.verdict is Verdict.PARK) == (permanent or exhausted)
    if decision.verdict is Verdict.RETRY:
        assert decision.delay == family.backoff.delay(attempts, rand)
        assert 0 < decision.delay <= 60
    else:
        assert decision.delay == 0


# -- the capped pick ----------------------------------------------------------------------------


@st.composite
def capped_claims(
    draw: st.DrawFn,
) -> tuple[list[Candidate], dict[str, int], int]:
    """Due rows in due order, ranked per actor and sorted (rank, due) as the SQL returns them,
    per-command caps, and the claim's limit."""
    actors = draw(st.lists(st.sampled_from([None, "a", "b", "c", "d", "e", "big"]), max_size=80))
    commands = [draw(st.sampled_from(["x", "y"])) for _ in actors]
    seen: Counter[str | None] = Counter()
    ranked = []
    for i, (actor, command) in enumerate(zip(actors, commands, strict=True)):
        seen[actor] += 1
        rank = 1 if actor is None else seen[actor]
        ranked.append((rank, i, Candidate(i + 1, actor, command, rank)))
    ranked.sort(key=lambda r: (r[0], r[1]))
    caps = {"x": draw(st.integers(1, 5)), "y": draw(st.integers(1, 5))}
    return [c for _, _, c in ranked], caps, draw(st.integers(0, 40))


def _plan(
    case: tuple[list[Candidate], dict[str, int], int],
) -> tuple[list[Candidate], list[Candidate], list[Candidate]]:
    candidates, caps, limit = case
    plan = plan_capped_claim(
        candidates,
        lambda c: None if c.actor is None else CapRule(c.command, caps[c.command]),
        limit,
    )
    decided = {c.id for c in plan.take} | {c.id for c in plan.wait}
    return plan.take, plan.wait, [c for c in candidates if c.id not in decided]


@given(capped_claims())
def test_no_actor_with_rows_left_is_more_than_one_row_behind_another(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    """Max-min fairness: an actor whose rows were left due (not at its cap) got at least as
    many rows as any other actor, less one: a backlog cannot take a small actor's share."""
    take, wait, left = _plan(case)
    taken = Counter(c.actor for c in take if c.actor is not None)
    waiting = {c.actor for c in wait}
    behind = {c.actor for c in left if c.actor is not None} - waiting
    for actor in behind:
        for other, n in taken.items():
            assert n <= taken[actor] + 1, (actor, other, dict(taken))


@given(capped_claims())
def test_a_claim_with_room_for_every_actor_serves_every_actor(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    """No starvation: when the limit covers every actor's first row (and the uncapped rows),
    every actor gets a row, whatever the size of the others' backlogs."""
    candidates, _, limit = case
    firsts = [c for c in candidates if c.rank == 1]
    assume(limit >= len(firsts))
    take, _, _ = _plan(case)
    assert {c.actor for c in take} == {c.actor for c in candidates}
    assert {c.id for c in firsts} <= {c.id for c in take}


@given(capped_claims())
@example(([Candidate(1, "a", "x", 1), Candidate(2, "a", "x", 2)], {"x": 1, "y": 1}, 5))
def test_rows_past_an_actors_cap_leave_the_due_range_and_uncapped_rows_never_wait(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    _, caps, limit = case
    take, wait, left = _plan(case)
    assert all(c.actor is not None for c in wait)
    per_slot = Counter((c.actor, c.command) for c in take)
    for c in wait:  # every waiting row's actor really is at the cap that applies to that row
        assert per_slot[(c.actor, c.command)] >= caps[c.command]
    if len(take) < limit:  # room left: nothing stays due that could have been taken
        assert left == []
