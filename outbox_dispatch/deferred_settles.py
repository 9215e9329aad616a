"""Deferred settles: delivered rows settled off the handler's critical path, in batches.

A worker's per-row cost is two Postgres round trips, begin and settle. Once a handler has
succeeded, its settle changes nothing the worker needs before it takes the next message, so
the worker hands it to this thread and moves on; the thread settles whatever gathered in one
fenced statement (``settle_many``). A settle the statement refuses (a cancel request arrived,
or the claim was lost) goes back to the one-row path, which records it as cancelled or lost.

What this costs: a worker killed between a handler's success and the flush (milliseconds)
leaves the row started, so it runs again after its lease with ``maybe_applied`` set, the same
outcome as a kill just before the settle. A capped row's slot is given back after the
statement that settled it committed, as on the one-row path. Ordered rows (their settle
promotes the actor's next row in the same transaction) and transactional handlers (their
settle is their commit) are not deferred.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from .errors import OutboxError
from .forksafe import ForkSafeLock
from .logs import event
from .rows import Started
from .settle import SettleKind
from .store import Store

log = logging.getLogger(__name__)

WINDOW = 0.002  # seconds the thread waits for more settles after the first


class DeferredSettles:
    def __init__(
        self,
        store: Store,
        refused: Callable[[SettleKind, Started], None],
        settled: Callable[[list[Started]], None] = lambda rows: None,
    ) -> None:
        self.store = store
        self.refused = refused  # the one-row settle, for rows the batch statement skipped
        self.settled = settled  # after the commit: give back the rows' cap slots
        self._pending: list[tuple[SettleKind, Started]] = []
        self._lock = ForkSafeLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, kind: SettleKind, started: Started) -> None:
        with self._lock:
            self._pending.append((kind, started))
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()  # a forked pool process starts its own thread
                self._thread = threading.Thread(
                    target=self._loop, name="outbox-settler", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def flush(self) -> None:
        """Settle everything pending now (worker shutdown, tests)."""
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._settle(batch)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(WINDOW)
            try:
                self.flush()
            except Exception as exc:  # never let the thread die: the next rows need it
                event(log, logging.ERROR, "settle_batch_failed", repr(exc))

    def _settle(self, batch: list[tuple[SettleKind, Started]]) -> None:
        by_kind: dict[SettleKind, list[Started]] = {}
        for kind, started in batch:
            by_kind.setdefault(kind, []).append(started)
        for kind, rows in by_kind.items():
            try:
                settled = self.store.settle_many(kind, [(s.id, s.token) for s in rows])
            except OutboxError as exc:
                # Postgres unreachable: the rows stay started and run again after their
                # lease with maybe_applied, as after a worker killed before its settle
                event(
                    log,
                    logging.WARNING,
                    "settle_deferred_failed",
                    f"{len(rows)} delivered rows not settled ({exc}); they run again after "
                    "their lease with maybe_applied",
                )
                continue
            self.settled([s for s in rows if s.id in settled])
            for s in rows:
                if s.id not in settled:
                    self.refused(kind, s)
