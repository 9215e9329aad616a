"""Pure decisions of delivery: time limits on the message, and which starts wait for the disk."""

from __future__ import annotations

import pytest

from outbox_dispatch import ConfigurationError, Family


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


def test_starts_wait_for_the_disk_only_where_a_lost_one_would_cost_more_than_a_flag() -> None:
    from outbox_dispatch.core.policy import LostAttempt, starts_flushed

    plain, parking = Family("plain"), Family("careful", on_lost=LostAttempt.PARK)
    assert not starts_flushed(plain, False)  # a lost start reruns flagged maybe_applied
    assert starts_flushed(parking, False)  # it would park rows that never ran
    assert starts_flushed(None, False)  # a message naming no family: the safe side
    assert starts_flushed(plain, True)  # a failover to a synchronous standby
