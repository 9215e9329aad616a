"""Pure decisions: backoff bounds, retry-or-park, claim limits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import Backoff, ConfigurationError, Family
from outbox_dispatch.core.policy import (
    Verdict,
    batch_after_cancel,
    batch_after_claim,
    builtin_families,
    decide_failure,
)


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"lease": 0.5},
        {"max_in_flight": 0},
        {"per_actor": 0},
        {"retention": -1},
        {"name": "Bad-Name"},
        {"name": "x" * 49},
    ],
)
def test_bad_family_policy_is_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"name": "ok", **kwargs}
    with pytest.raises(ConfigurationError):
        Family(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"base": 0}, {"base": 2, "cap": 1}, {"jitter": 1.5}, {"base": float("inf")}]
)
def test_bad_backoff_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        Backoff(**kwargs)


def test_builtin_families() -> None:
    fams = builtin_families()
    assert fams["intent"].max_attempts is None
    assert fams["job"].max_attempts is not None
    assert fams["job"].lease > fams["intent"].lease


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5"])
def test_time_limit_must_be_positive_seconds(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="time_limit"):
        Family("limited", time_limit=bad)  # type: ignore[arg-type]


def test_time_limits_go_on_the_message_with_a_hard_limit_past_the_soft_one() -> None:
    from uuid import uuid4

    from outbox_dispatch.claim.publisher import batch_options, message_options
    from outbox_dispatch.core.rows import Claimed

    row = Claimed(1, uuid4(), "c", None, 1)
    assert "time_limit" not in message_options(Family("plain"), row, "q")
    opts = message_options(Family("limited", time_limit=20), row, "q")
    assert (opts["soft_time_limit"], opts["time_limit"]) == (20, 22)
    short = message_options(Family("limited", time_limit=2), row, "q")
    assert (short["soft_time_limit"], short["time_limit"]) == (2, 3)
    batch = batch_options(Family("limited", time_limit=2, batch=5), [row, row], "q")
    assert (batch["soft_time_limit"], batch["time_limit"]) == (4, 6)


def test_broker_room_counts_queued_messages_as_rows() -> None:
    from outbox_dispatch.core.policy import broker_room

    assert broker_room(100, 0, 1) == 100
    assert broker_room(100, 40, 1) == 60
    assert broker_room(100, 3, 50) == 0  # three batched messages of 50 rows fill it
    assert broker_room(100, 500, 1) == 0  # never negative


def test_room_below_the_refill_mark_counts_as_none() -> None:
    from outbox_dispatch.core.policy import broker_room, refill_mark

    assert refill_mark(1000) == 250
    assert refill_mark(3) == 1  # a tiny family still claims its one free row
    assert broker_room(1000, 750, 1) == 250
    assert broker_room(1000, 751, 1) == 0  # three quarters queued: nothing to top up yet
    assert broker_room(3, 2, 1) == 1
    assert broker_room(60, 1, 50) == 0  # one batched message of 50 leaves 10 < 15


def test_starts_wait_for_the_disk_only_where_a_lost_one_would_cost_more_than_a_flag() -> None:
    from outbox_dispatch.core.policy import LostAttempt, starts_flushed

    plain, parking = Family("plain"), Family("careful", on_lost=LostAttempt.PARK)
    assert not starts_flushed(plain, False)  # a lost start reruns flagged maybe_applied
    assert starts_flushed(parking, False)  # it would park rows that never ran
    assert starts_flushed(None, False)  # a message naming no family: the safe side
    assert starts_flushed(plain, True)  # a failover to a synchronous standby


@given(st.integers(min_value=1, max_value=100_000), st.integers(min_value=1, max_value=100_000))
def test_a_cancelled_claims_cut_halves_and_grows_back_to_the_batch(tried: int, batch: int) -> None:
    """After a cancelled claim the next takes half (never none); each claim that goes through
    doubles the cut until it reaches the batch, where the cut ends."""
    cut = batch_after_cancel(tried)
    assert cut >= 1 and (cut == 1 or cut * 2 <= tried)
    steps = 0
    limit: int | None = cut
    while limit is not None:
        assert limit < batch or steps == 0
        limit = batch_after_claim(limit, batch)
        steps += 1
    assert steps <= batch.bit_length() + 1  # back to the batch within log2(batch) claims


def test_the_cut_examples() -> None:
    assert [batch_after_cancel(n) for n in (1, 2, 500, 501)] == [1, 1, 250, 250]
    assert [batch_after_claim(c, 500) for c in (1, 200, 250, 499)] == [2, 400, None, None]
