"""How many of a claim's one-row messages the claiming worker keeps for itself
(policy.local_feed): its share, a fraction of a second of its work, and nothing when the
broker's part could age towards the lease."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.policy import (
    FEED_HORIZON,
    FEED_MOST,
    FEED_ROW_LEAST,
    FEED_SHARE_MOST,
    FeedBasis,
    local_feed,
)

SHORT = FeedBasis(consumers=2, run_time=0.0003, max_in_flight=1000, lease=60.0)


@given(
    consumers=st.integers(0, 512),
    run_time=st.floats(0, 3600),
    max_in_flight=st.integers(1, 1_000_000),
    lease=st.floats(1, 3600),
    processes=st.integers(0, 64),
    offered=st.integers(0, 5000),
    waiting=st.integers(0, 5000),
)
def test_the_feed_stays_within_the_share_the_horizon_and_the_lease(
    consumers: int,
    run_time: float,
    max_in_flight: int,
    lease: float,
    processes: int,
    offered: int,
    waiting: int,
) -> None:
    basis = FeedBasis(consumers, run_time, max_in_flight, lease)
    kept = local_feed(basis, processes, offered, waiting)
    procs = max(1, processes)
    share = min(FEED_SHARE_MOST, procs / max(procs, consumers))
    assert 0 <= kept <= offered * share  # at least a quarter goes through the broker
    assert kept + waiting <= FEED_MOST or kept == 0
    per_row = max(run_time, FEED_ROW_LEAST)
    assert kept == 0 or (kept + waiting) * per_row <= procs * FEED_HORIZON
    # what the broker gets drains (1 - share) as fast: the in-flight work fits half the lease
    assert kept == 0 or max_in_flight * per_row / max(procs, consumers) / (1 - share) <= lease / 2


def test_a_lone_worker_keeps_three_quarters_of_a_claim_and_a_quarter_second_of_work() -> None:
    assert local_feed(SHORT, 2, 100, 0) == 75
    # a row counts 2 ms at least: two processes get through 250 in a quarter second
    assert local_feed(SHORT, 2, 1000, 0) == 250
    assert local_feed(SHORT, 2, 1000, 240) == 10
    assert local_feed(SHORT, 2, 1000, 300) == 0
    assert local_feed(SHORT, 2, 1, 0) == 0  # a lone row: the prefetch room decides


def test_one_worker_of_four_keeps_its_share() -> None:
    basis = FeedBasis(consumers=8, run_time=0.0003, max_in_flight=1000, lease=60.0)
    assert local_feed(basis, 2, 400, 0) == 100


def test_slow_handlers_or_a_tight_lease_keep_the_broker_path() -> None:
    # 100 ms handlers: a quarter second is five rows for two processes
    slow = FeedBasis(consumers=2, run_time=0.1, max_in_flight=10, lease=60.0)
    assert local_feed(slow, 2, 100, 0) == 5
    # the same in-flight work through the broker a quarter as fast would outlive half the lease
    tight = FeedBasis(consumers=2, run_time=0.1, max_in_flight=1000, lease=60.0)
    assert local_feed(tight, 2, 100, 0) == 0
