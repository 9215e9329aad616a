"""How many rows a claim packs into each delivery message (policy.rows_per_message)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import ConfigurationError, Family
from outbox_dispatch.core.policy import (
    ADAPTIVE_BATCH,
    LEASE_SHARE,
    SPREAD,
    claim_can_wait,
    rows_per_message,
)


@given(
    rows=st.integers(0, 5000),
    most=st.integers(1, 1000),
    consumers=st.integers(1, 64),
    queued=st.integers(0, 10_000),
    run_time=st.one_of(st.none(), st.floats(1e-6, 1000)),
    lease=st.floats(1, 3600),
)
def test_message_sizes_stay_in_their_bounds(
    rows: int, most: int, consumers: int, queued: int, run_time: float | None, lease: float
) -> None:
    size = rows_per_message(
        rows, most=most, consumers=consumers, queued=queued, run_time=run_time, lease=lease
    )
    assert 1 <= size <= most
    if rows <= consumers:  # low load: one row per message
        assert size == 1
    if size > 1 and run_time is not None:  # a message's rows fit a tenth of the lease
        assert size * run_time <= lease * LEASE_SHARE
    if queued == 0 and run_time is None and most >= rows > consumers and most > 1:
        # an idle queue: the rows are spread over SPREAD messages per consumer (or one per
        # row): the smallest size that fits them in that many messages
        spread = min(rows, consumers * SPREAD)
        assert size * spread >= rows > (size - 1) * spread


def test_a_backlog_is_spread_over_the_consumers_and_a_busy_queue_gets_bigger_messages() -> None:
    idle = rows_per_message(500, most=100, consumers=2, queued=0, run_time=None, lease=60)
    busy = rows_per_message(500, most=100, consumers=2, queued=50, run_time=None, lease=60)
    assert idle == 63  # 8 messages for 2 consumers
    assert busy == 100  # the consumers have work queued: fewer, fuller messages
    slow = rows_per_message(500, most=100, consumers=2, queued=0, run_time=0.5, lease=60)
    assert slow == 12  # 12 half-second rows fill the 6 s share of a 60 s lease
    assert rows_per_message(2, most=100, consumers=2, queued=0, run_time=None, lease=60) == 1


@given(queued=st.integers(0, 10_000), consumers=st.integers(-1, 64), most=st.integers(1, 1000))
def test_a_claim_waits_only_while_every_consumer_has_spread_messages_queued(
    queued: int, consumers: int, most: int
) -> None:
    """The listener leaves a family's rows in Postgres while its queue holds SPREAD messages
    per consumer; an empty queue is always claimed, more queued never turns a wait back into
    a claim, and a family pinned to one row per message never waits."""
    assert not claim_can_wait(0, consumers, most)
    assert not claim_can_wait(queued, consumers, 1)
    if claim_can_wait(queued, consumers, most):
        assert claim_can_wait(queued + 1, consumers, most)
        assert queued >= SPREAD  # at least one consumer's worth, whatever was passed
    assert claim_can_wait(max(1, consumers) * SPREAD, consumers, most) == (most > 1)


def test_two_consumers_wait_from_eight_queued_messages() -> None:
    assert [claim_can_wait(q, 2, 100) for q in (0, 7, 8, 50)] == [False, False, True, True]
    assert claim_can_wait(4, 0, 100) and not claim_can_wait(3, 0, 100)  # no consumer known
    assert not claim_can_wait(50, 2, 1)  # batch=1: nothing to pack


def test_batch_none_is_adaptive_and_bad_batches_are_refused() -> None:
    assert Family("x").batch is None and Family("x").most_per_message == ADAPTIVE_BATCH
    assert Family("x", batch=1).most_per_message == 1
    for bad in (0, 1001, True, 2.5):
        with pytest.raises(ConfigurationError, match="batch must be None"):
            Family("x", batch=bad)  # type: ignore[arg-type]
    Family("x", batch=10, per_actor=2)  # capped families batch
    Family("x", batch=10, ordered=True)  # and ordered ones
