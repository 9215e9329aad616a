"""Families of the caps tests, shared by the worker app and the tests' producer."""

from __future__ import annotations

from outbox_dispatch import Backoff, Dispatcher


def declare_families(d: Dispatcher, lease: float, heartbeat_timeout: float = 0.0) -> None:
    """``heartbeat_timeout``: the capped family's (0: the lease, as every other family's)."""
    beat = heartbeat_timeout or lease
    d.family("capped", per_actor=2, lease=lease, heartbeat_timeout=beat, max_in_flight=200)
    d.family("fair", per_actor=1, lease=lease, heartbeat_timeout=lease, max_in_flight=200)
    d.family(
        "lined",
        ordered=True,
        lease=lease,
        heartbeat_timeout=lease,
        max_attempts=10,
        backoff=Backoff(0.05, 0.2),
    )
