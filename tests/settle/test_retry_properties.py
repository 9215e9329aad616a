"""Property-based tests of the retry decisions that test_retry_policy leaves open: backoff
growth and the park verdict."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import Backoff, Family
from outbox_dispatch.core.bounds import MAX_BACKOFF
from outbox_dispatch.core.policy import Verdict, decide_failure

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
