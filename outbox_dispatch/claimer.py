"""Moves due rows into Celery queues: claim per family in Postgres, commit, then publish.

The message carries only (row id, claim token). Publishing happens after the claim commits,
so a delivery never sees a token that is not yet visible; a claimer that dies between commit
and publish leaves leased rows that are claimed again after the lease, without an attempt
counted (their claim never started).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .logs import event
from .policy import Family, LostAttempt
from .store import Claimed, ClaimResult, Store

log = logging.getLogger(__name__)

Publisher = Callable[[Family, list[Claimed]], None]


@dataclass
class ClaimReport:
    claimed: dict[str, int] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    @property
    def total(self) -> int:
        return sum(self.claimed.values())


class Claimer:
    def __init__(self, store: Store, families: Mapping[str, Family], *, batch: int = 500) -> None:
        self.store = store
        self.families = families
        self.batch = batch

    def claim_family(self, family: Family, *, batch: int | None = None) -> ClaimResult:
        t0 = time.perf_counter()
        result = self.store.claim(
            family=family.name,
            batch=batch or self.batch,
            lease=family.lease,
            max_in_flight=family.max_in_flight,
            max_attempts=family.max_attempts,
            park_lost=family.on_lost is LostAttempt.PARK,
        )
        for row_id in result.parked:
            event(
                log,
                logging.ERROR,
                "parked",
                "row parked at claim: its last attempt ended without an outcome "
                "(handler crashed its worker or overran its lease)",
                row_id=row_id,
                family=family.name,
            )
        if result.claimed:
            event(
                log,
                logging.DEBUG,
                "claimed",
                f"{len(result.claimed)} rows in {(time.perf_counter() - t0) * 1000:.1f} ms",
                family=family.name,
            )
        return result

    def run(self, publish: Publisher, *, budget: float = 1.0) -> ClaimReport:
        """Claim and publish every family until none fills a batch or ``budget`` seconds pass."""
        report = ClaimReport()
        deadline = time.monotonic() + budget
        pending = list(self.families.values())
        while pending:
            report.rounds += 1
            full: list[Family] = []
            for family in pending:
                result = self.claim_family(family)
                if result.claimed:
                    publish(family, result.claimed)
                _add(report.claimed, family.name, len(result.claimed))
                _add(report.parked, family.name, len(result.parked))
                if result.limit > 0 and len(result.claimed) + len(result.parked) >= result.limit:
                    full.append(family)
            pending = full
            if time.monotonic() >= deadline:
                break
        return report


def _add(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


def message_options(family: Family, row: Claimed, queue: str) -> dict[str, Any]:
    """Celery publish options: Flower shows ``<family>:<command>`` with row id and actor."""
    return {
        "queue": queue,
        "routing_key": queue,
        "shadow": f"{family.name}:{row.command}",
        "argsrepr": f"(row={row.id}, actor={row.actor!r}, attempt={row.attempts})",
        "kwargsrepr": "{}",
    }
