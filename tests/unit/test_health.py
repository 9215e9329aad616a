"""The breaker that keeps a down database from costing the others (health.py), on a fake
clock: new work fails at once while the database is in its back-off, one call probes it after,
and the back-off doubles up to its cap."""

from __future__ import annotations

import pytest

from outbox_dispatch.errors import DatabaseUnavailable
from outbox_dispatch.health import (
    FIRST_BACKOFF,
    MAX_BACKOFF,
    NEW_WORK_TIMEOUT,
    PROBE_TIMEOUT,
    Breaker,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_down_database_is_probed_by_one_call_after_a_growing_back_off() -> None:
    clock = Clock()
    b = Breaker("eu", clock)
    assert b.admit() == NEW_WORK_TIMEOUT  # up
    b.failed("connection refused")
    with pytest.raises(DatabaseUnavailable, match="'eu' is not answering") as refused:
        b.admit()
    assert refused.value.repeated
    waits = []
    for _ in range(6):
        waits.append(b._down_until - clock.now)
        clock.now = b._down_until
        assert b.admit() == PROBE_TIMEOUT  # one probe, with a short wait
        with pytest.raises(DatabaseUnavailable):
            b.admit()  # the others while it probes
        b.failed("connection refused")
    assert waits == [FIRST_BACKOFF, 2, 4, 8, MAX_BACKOFF, MAX_BACKOFF]
    clock.now = b._down_until
    assert b.admit() == PROBE_TIMEOUT
    b.succeeded()
    assert not b.down and b.admit() == NEW_WORK_TIMEOUT
    b.failed("again")
    assert b._down_until - clock.now == FIRST_BACKOFF  # a new outage starts over
