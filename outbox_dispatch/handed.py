"""Rows this worker handed over unclaimed (listener.py): its own claims leave them alone for a
moment, so that the start each was handed to claims it.

A named row is handed to a pool process with no claim in Postgres: until its start claims it,
it is due like any other row, and a claim of its family, made by the same listener a few
milliseconds later for the rows it could not hand over, used to take it too. The start then
found its row claimed by someone else and dropped its message, and the row waited for the
claim's message, behind the others (seen at 120 rows/s: forty rows in a row took both
paths, 90 ms from commit to start at the median). So the listener's claims skip
the rows it handed over in the last ``HOLD`` seconds. A start that does not come (its process
died, or the family had no room in flight) leaves its row to the claims after that. Other
processes' claims (beat's safety net) know nothing of it: a row they take is dropped at its
start as before, never run twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from .forksafe import ForkSafeLock

HOLD = 0.25  # seconds a handed row is left to its start: it starts within milliseconds


class HandedRows:
    def __init__(self, hold: float = HOLD) -> None:
        self.hold = hold
        self._lock = ForkSafeLock()
        self._until: dict[str, dict[int, float]] = {}  # family -> row id -> left alone until

    def add(self, family: str, ids: Iterable[int]) -> None:
        """Remember rows handed over now; those past their hold are forgotten here too, as a
        family whose rows all start where they were handed is never claimed by this worker."""
        now = time.monotonic()
        until = now + self.hold
        with self._lock:
            rows = self._live(family, now)
            for row_id in ids:
                rows[row_id] = until

    def held(self, family: str) -> list[int]:
        """The family's rows a claim leaves alone now (those past their hold are forgotten)."""
        with self._lock:
            return list(self._live(family, time.monotonic()))

    def __len__(self) -> int:
        """Rows remembered, in every family."""
        with self._lock:
            return sum(len(rows) for rows in self._until.values())

    def _live(self, family: str, now: float) -> dict[int, float]:
        """The family's rows still held (called with the lock held)."""
        rows = self._until.get(family, {})
        live = {row_id: t for row_id, t in rows.items() if t > now}
        self._until[family] = live
        return live
