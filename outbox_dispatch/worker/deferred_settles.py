"""Deferred settles: delivered rows settled off the handler's critical path.

A worker's per-row cost is two Postgres round trips, start and settle. Once a handler has
succeeded, its settle changes nothing the worker needs before it takes the next row, so the
worker hands it here and moves on. The next delivery start in this process carries it: the
statement that starts the next attempt first settles the row delivered before it (one row
deleted, one kept as done; ``Store.start``), and it commits with the start, before the next
handler runs. What no start carried within ``timings.SETTLE_WINDOW`` (the last row of a
burst, low load) this module's thread settles, several rows per fenced statement. A settle
that is refused (a cancel request arrived, or the claim was lost) goes back to the one-row
path, which records it as cancelled or lost.

What this costs: a worker killed between a handler's success and the next start (or the
thread's statement) leaves the row started, so it runs again after its lease with
``maybe_applied`` set, the same outcome as a kill just before the settle. Ordered rows (their
settle promotes the actor's next row in the same transaction) and transactional handlers
(their settle is their commit) are not deferred.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from uuid import UUID

from outbox_dispatch.core import timings
from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import SettleKind
from outbox_dispatch.store import Store
from outbox_dispatch.store.health import when_answering

log = logging.getLogger(__name__)


Pending = list[tuple[SettleKind, Started]]


def by_kind(batch: Pending) -> dict[SettleKind, list[tuple[int, Started]]]:
    """The rows of a batch per settle kind, as (id, row), in the order they were added."""
    out: dict[SettleKind, list[tuple[int, Started]]] = {}
    for kind, started in batch:
        out.setdefault(kind, []).append((started.id, started))
    return out


def carried(batch: Pending) -> dict[SettleKind, tuple[int, UUID]]:
    """What a start's statement settles: the (id, token) of each kind's row in ``batch``."""
    return {kind: (s.id, s.token) for kind, s in batch}


class DeferredSettles:
    def __init__(
        self,
        store: Store,
        refused: Callable[[SettleKind, Started], None],
    ) -> None:
        self.store = store
        self.refused = refused  # the one-row settle, for rows the batch statement skipped
        self._pending: Pending = []
        self._after: list[tuple[SettleKind, Started]] = []  # refused settles a start carried
        self._first_add = 0.0
        self._idle = False  # the thread waits for work (not sleeping until a row is due)
        self._lock = ForkSafeLock()
        # held while a batch is settled: a flush waits for the thread's batch in flight (its
        # callers count on every row handed here being settled once it returns)
        self._settling = ForkSafeLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, kind: SettleKind, started: Started) -> None:
        """A delivered row to settle."""
        with self._lock:
            self._pending.append((kind, started))
            if len(self._pending) == 1:
                self._first_add = time.monotonic()
            wake = self._rouse()
        if wake:
            self._wake.set()

    def take(self) -> Pending:
        """Everything pending (the thread, a flush). What it settles ends the flow the
        thread stays awake for (``_loop``): after a flush it goes idle, not waiting out a
        timings.SETTLE_WINDOW that a test may have made long."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._first_add = 0.0
        return batch

    def take_for_start(self) -> Pending:
        """What a start carries: the last pending row of each kind (a start settles at most
        one row of each), the rest stays for the thread; see ``landed`` and ``give_back``."""
        with self._lock:
            last = {kind: k for k, (kind, _s) in enumerate(self._pending)}
            picked = set(last.values())
            batch = [p for k, p in enumerate(self._pending) if k in picked]
            self._pending = [p for k, p in enumerate(self._pending) if k not in picked]
        return batch

    def give_back(self, batch: Pending) -> None:
        """A start that failed before its transaction committed: the rows are pending again."""
        if not batch:
            return
        with self._lock:
            self._pending[:0] = batch
            self._first_add = time.monotonic()
            wake = self._rouse()
        if wake:
            self._wake.set()

    def landed(self, batch: Pending, settled: set[int]) -> None:
        """A start's statement settled ``settled`` of ``batch``: the refused ones go to the
        one-row path, by the thread."""
        refused = [(kind, s) for kind, s in batch if s.id not in settled]
        if not refused:
            return
        with self._lock:
            self._after += refused
            wake = self._rouse()
        if wake:
            self._wake.set()

    def flush(self) -> None:
        """Settle everything pending now (the end of a batched message, worker shutdown,
        tests), and finish what the starts that carried settles left to do. A batch the
        thread took and has not settled yet is waited for, so that a flush at shutdown does
        not let the process exit mid-statement and the rows run again."""
        self._settle_now()
        self._wake.set()  # a thread waiting for a row that is settled now looks again

    def _rouse(self) -> bool:
        """Called with the lock held after adding work: whether the thread must be woken (it
        waits for work; when it sleeps until a row is due, it finds the new work then)."""
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()  # a forked pool process starts its own thread
            self._idle = False
            self._thread = threading.Thread(target=self._loop, name="outbox-settler", daemon=True)
            self._thread.start()
            return True  # it starts by waiting to be woken
        wake, self._idle = self._idle, False
        return wake

    def _loop(self) -> None:
        self._wake.wait()
        while True:
            try:
                with self._lock:
                    wait = self._wait()
                    # nothing pending, but a row came less than a window ago: rows are flowing,
                    # and a start has just taken the last one while the next handler runs (most
                    # of a busy process's time). Idle then, the thread would be woken again by
                    # nearly every row delivered (two switches of the GIL a row), so it looks
                    # again once the flow has paused for a window, and goes idle only then
                    quiet = wait is None and not self._after
                    flowing = (
                        self._first_add + timings.SETTLE_WINDOW - time.monotonic() if quiet else 0.0
                    )
                    idle = quiet and flowing <= 0
                    self._idle = idle
                    self._wake.clear()
                if idle:
                    self._wake.wait()
                elif quiet:
                    self._wake.wait(flowing)
                elif wait is not None and wait > 0:
                    # a start may carry the row meanwhile; a flush wakes this early
                    self._wake.wait(min(wait, timings.SETTLE_WINDOW))
                else:
                    self._settle_now()
            except Exception as exc:  # never let the thread die: the next rows need it
                event(log, logging.ERROR, "settle_batch_failed", repr(exc))
                time.sleep(timings.SETTLE_WINDOW)

    def _settle_now(self) -> None:
        with self._settling:
            self._finish(self._settle(self.take()))

    def _wait(self) -> float | None:
        """Seconds until the oldest pending row is the thread's to settle (None: nothing is
        pending); called with the lock held."""
        if not self._pending:
            return None
        return self._first_add + timings.SETTLE_WINDOW - time.monotonic()

    def _finish(self, refused: list[tuple[SettleKind, Started]]) -> None:
        """After settles committed: record the refused settles (also those a start carried)
        on the one-row path."""
        with self._lock:
            refused, self._after = [*refused, *self._after], []
        for kind, s in refused:
            try:
                self.refused(kind, s)
            except Exception as exc:  # one row's failure must not drop the others' records
                event(
                    log,
                    logging.WARNING,
                    "settle_refused_failed",
                    f"a refused settle could not be recorded ({exc!r}); the row runs again "
                    "after its lease with maybe_applied",
                    row_id=s.id,
                    family=s.family,
                    command=s.command,
                    actor=s.actor,
                    attempt=s.attempts,
                )

    def _settle(self, batch: Pending) -> list[tuple[SettleKind, Started]]:
        """Settle a batch, one statement per kind; returns the refused rows."""
        refused: list[tuple[SettleKind, Started]] = []
        for kind, rows in by_kind(batch).items():
            pairs = [(i, s.token) for i, s in rows]
            try:
                settled = when_answering(
                    partial(self.store.settle_many, kind, pairs),
                    self.store.outage,
                    "deferred settle",
                )
            except OutboxError as exc:
                # Postgres did not come back in time: the rows stay started and run again
                # after their lease with maybe_applied, as after a worker killed before its settle
                event(
                    log,
                    logging.WARNING,
                    "settle_deferred_failed",
                    f"{len(rows)} delivered rows not settled ({exc}); they run again after "
                    "their lease with maybe_applied",
                )
                continue
            refused += [(kind, s) for i, s in rows if i not in settled]
        return refused
