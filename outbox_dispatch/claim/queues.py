"""Broker queue lengths: how many messages wait in a family's Celery queue. The claimer reads
them to keep its room (max_in_flight rows queued at most), metrics and status to show them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kombu.transport.virtual import Transport as VirtualTransport

from outbox_dispatch.core import timings
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import Family

log = logging.getLogger(__name__)


class QueueProbe:
    def __init__(self, app: Any, queue_name: Callable[[str], str]) -> None:
        self.app = app
        self.queue_name = queue_name
        self._sizes: dict[str, tuple[int, float]] = {}

    def lengths(self, families: Iterable[Family]) -> dict[str, int]:
        """Each family's queue length; a family whose queue the broker cannot report is left
        out."""
        sizes = {fam.name: self.length(fam) for fam in families}
        return {name: n for name, n in sizes.items() if n is not None}

    def queued(self, family: Family) -> int:
        """Messages waiting in the family's queue, for the claimer's broker room. Read at most
        every timings.QUEUE_TTL seconds: a burst of claims costs one broker round trip."""
        cached = self._sizes.get(family.name)
        if cached is not None and time.monotonic() - cached[1] < timings.QUEUE_TTL:
            return cached[0]
        size = self.length(family) or 0  # unknown: Postgres alone limits the claim
        self._sizes[family.name] = (size, time.monotonic())  # failures are cached too
        return size

    def length(self, family: Family) -> int | None:
        """None when the broker cannot say (down, or the queue never declared on AMQP); one
        quick connection attempt, so an outage does not stall claims and scrapes."""
        queue = self.queue_name(family.name)
        try:
            with self.app.pool.acquire(block=True, timeout=2) as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=1)
                if isinstance(conn.transport, VirtualTransport):
                    # Redis keeps no queue objects: a declare creates nothing and reads every
                    # priority list in one round trip (a passive one misses prefixed keys)
                    return int(conn.default_channel.queue_declare(queue).message_count)
                with conn.channel() as probe:  # AMQP closes a channel on a missing queue
                    return int(probe.queue_declare(queue, passive=True).message_count)
        except Exception as exc:
            event(log, logging.DEBUG, "queue_size_failed", repr(exc), family=family.name)
            return None
