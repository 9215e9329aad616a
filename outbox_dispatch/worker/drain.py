"""drain(): claim and deliver in this process until nothing is due, for tests and scripts
(the pytest plugin and ``Dispatcher.drain`` use it); no broker, no worker."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from outbox_dispatch.claim.claimer import Claimer
from outbox_dispatch.core.errors import DrainLoop, DrainTimeout
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.worker.delivery import Delivery


@dataclass
class DrainReport:
    """What a drain did, by outcome."""

    outcomes: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.get(outcome.value, 0)

    @property
    def delivered(self) -> int:
        return self.count(Outcome.DELIVERED)


def drain(
    parts: Sequence[tuple[Claimer, Delivery]],
    families: Mapping[str, Family],
    timeout: float = 30.0,
    max_rounds: int = 100,
) -> DrainReport:
    """Claim and deliver in this process until nothing is due. For tests and scripts.
    ``parts``: each database's claimer and delivery.

    Raises DrainLoop when deliveries keep making new due work for ``max_rounds`` rounds that
    each took every due row, and DrainTimeout when ``timeout`` seconds pass first.
    """
    report = DrainReport()
    deadline = time.monotonic() + timeout
    idle_rounds = 0
    while True:
        took_all = True
        batch: list[tuple[Delivery, Family, Claimed]] = []
        for claimer, delivery in parts:
            for fam in list(families.values()):
                result = claimer.claim_family(fam)
                batch.extend((delivery, fam, c) for c in result.claimed)
                _bump(report.outcomes, Outcome.PARKED.value, len(result.parked))
                if result.limit == 0 or len(result.claimed) + len(result.parked) >= result.limit:
                    took_all = False
        if not batch and took_all:
            return report
        report.rounds += 1
        if took_all:
            idle_rounds += 1
            if idle_rounds > max_rounds:
                raise DrainLoop(
                    f"drain: deliveries kept staging due rows for {max_rounds} rounds "
                    f"({report.outcomes}): a handler probably enqueues itself without end"
                )
        for delivery, fam, c in batch:  # each row as a delivery worker runs it, batched or not
            res = delivery.deliver(c.id, c.token, family_hint=fam.name)
            _bump(report.outcomes, res.outcome.value, 1)
        if time.monotonic() > deadline:
            raise DrainTimeout(
                f"drain: {timeout} s passed with rows still due ({report.outcomes}): "
                "raise the timeout or look for slow handlers"
            )


def _bump(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n
