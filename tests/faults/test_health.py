"""The breaker that keeps a down database from costing the others (health.py), on a fake
clock: new work fails at once while the database is in its back-off, one call probes it after,
only the probe's outcome opens or closes it, and the back-off doubles up to its cap."""

from __future__ import annotations

import pytest

from outbox_dispatch.core.errors import DatabaseUnavailable
from outbox_dispatch.store.health import (
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
    first, straggler = b.admit(), b.admit()
    assert (first.timeout, first.probe) == (NEW_WORK_TIMEOUT, False)
    b.failed(first, "connection refused")
    b.failed(straggler, "connection refused")  # admitted before the trip: changes nothing
    b.succeeded(straggler)  # nor does its success
    with pytest.raises(DatabaseUnavailable, match="'eu' is not answering") as refused:
        b.admit()
    assert refused.value.repeated
    waits = []
    for _ in range(6):
        waits.append(b._down_until - clock.now)
        clock.now = b._down_until
        probe = b.admit()
        assert (probe.timeout, probe.probe) == (PROBE_TIMEOUT, True)
        with pytest.raises(DatabaseUnavailable):
            b.admit()  # the others while it probes
        b.failed(probe, "connection refused")
    assert waits == [FIRST_BACKOFF, 2, 4, 8, MAX_BACKOFF, MAX_BACKOFF]
    clock.now = b._down_until
    probe = b.admit()
    b.abandoned(probe)  # ended by its own error or a time limit: decides nothing
    assert b.down
    probe = b.admit()  # the next call probes at once
    b.succeeded(probe)
    assert not b.down and not b.admit().probe
    b.failed(b.admit(), "again")
    assert b._down_until - clock.now == FIRST_BACKOFF  # a new outage starts over
