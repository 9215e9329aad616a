"""Pure decisions of retries: backoff bounds and growth, retry or park."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import Backoff, Family
from outbox_dispatch.core.policy import Verdict, decide_failure


@given(
    base=st.floats(0.01, 100),
    factor=st.floats(1, 1000),
    jitter=st.floats(0, 1),
    attempts=st.integers(-5, 10_000),
    rand=st.floats(0, 1, exclude_max=True),
)
def test_backoff_stays_within_its_bounds(
    base: float, factor: float, jitter: float, attempts: int, rand: float
) -> None:
    b = Backoff(base=base, cap=base * factor, jitter=jitter)
    delay = b.delay(attempts, rand)
    assert 0 < delay <= b.cap
    raw = min(b.cap, base * 2.0 ** (max(attempts, 1) - 1)) if attempts < 1000 else b.cap
    assert delay >= raw * (1 - jitter) * 0.999999


def test_backoff_doubles_until_the_cap() -> None:
    b = Backoff(base=1, cap=10, jitter=0)
    assert [b.delay(n, 0.5) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


@given(attempts=st.integers(1, 50), max_attempts=st.integers(1, 20))
def test_park_exactly_when_attempts_run_out(attempts: int, max_attempts: int) -> None:
    fam = Family("f", max_attempts=max_attempts)
    verdict = decide_failure(fam, attempts, 0.3).verdict
    assert (verdict is Verdict.PARK) == (attempts >= max_attempts)


@given(attempts=st.integers(1, 10**6))
def test_unbounded_family_never_parks_on_failure(attempts: int) -> None:
    decision = decide_failure(Family("f", max_attempts=None), attempts, 0.9)
    assert decision.verdict is Verdict.RETRY
    assert decision.delay > 0


def test_permanent_failure_parks_on_the_first_attempt() -> None:
    assert (
        decide_failure(Family("f", max_attempts=None), 1, 0, permanent=True).verdict is Verdict.PARK
    )
