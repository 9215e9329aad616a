"""Pure decisions of claims: the broker's room counted in rows, and the cut that a cancelled
claim makes to its family's batch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.core.policy import batch_after_cancel, batch_after_claim


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
