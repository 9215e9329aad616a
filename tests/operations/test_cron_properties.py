"""Property-based tests of cron ticks: catch-up, windows, time zones, pass after pass."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter  # type: ignore[import-untyped]
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from outbox_dispatch.core.cron import MAX_TICKS, CatchUp, due_ticks

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
