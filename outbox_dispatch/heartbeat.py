"""Lease heartbeats for running handlers: one thread per process renews, every lease/3, the
leases (and cap slots) of every handler still running, and tells a handler when its claim was
lost or someone asked to cancel it. Short handlers finish before their first renewal, so they
cost a dict insert and delete."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from .errors import OutboxError
from .handlers import Context
from .logs import event
from .store import Store

log = logging.getLogger(__name__)

TICK = 0.25  # how often the thread looks for leases to renew


@dataclass
class Running:
    ctx: Context
    token: UUID
    lease: float
    transactional: bool  # its own transaction holds the row: renew the slot, not the row
    renew_slot: Callable[[], bool] | None
    next_at: float
    progress: Any = None
    cancel_requested: bool = field(default=False)
    deadline: float | None = None  # monotonic time past which the attempt is ended


class Heartbeats:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._running: dict[int, Running] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, entry: Running) -> None:
        with self._lock:
            self._running[entry.ctx.row_id] = entry
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, name="outbox-heartbeat", daemon=True
                )
                self._thread.start()

    def remove(self, row_id: int) -> None:
        with self._lock:
            self._running.pop(row_id, None)

    def beat_now(self, row_id: int, progress: Any = None) -> bool:
        """A handler's own ``ctx.heartbeat()``: renew at once; False if the claim is lost."""
        with self._lock:
            entry = self._running.get(row_id)
        if entry is None:
            return False
        if progress is not None:
            entry.progress = progress
        self._renew([entry])
        return not entry.ctx.cancelled.is_set()

    def _loop(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self._lock:
                due = [e for e in self._running.values() if e.next_at <= now or _overdue(e, now)]
            if due:
                try:
                    self._renew(due)
                except OutboxError as exc:  # Postgres unreachable: try again next tick
                    for e in due:
                        e.next_at = time.monotonic() + TICK
                    event(log, logging.WARNING, "heartbeat_failed", str(exc))

    def _renew(self, entries: list[Running]) -> None:
        now = time.monotonic()
        by_lease: dict[float, list[Running]] = {}
        for e in entries:
            e.next_at = now + e.lease / 3
            if e.deadline is not None and now >= e.deadline:
                # not renewed any more: the lease runs out and the row is claimed again, even
                # when the pool cannot interrupt the handler (threads)
                self._lost(e, "handler ran past its family's time_limit; its lease is not renewed")
                continue
            if e.renew_slot is not None and not e.renew_slot():
                self._lost(e, "cap slot lapsed (another row of the actor may hold it now)")
                continue
            if e.transactional:
                continue
            by_lease.setdefault(e.lease, []).append(e)
        for lease, group in by_lease.items():
            held = self.store.renew([(e.ctx.row_id, e.token, e.progress) for e in group], lease)
            for e in group:
                if e.ctx.row_id not in held:
                    self._lost(e, "claim lost (lease ran out and the row was claimed again)")
                elif held[e.ctx.row_id]:
                    self._cancel(e)
        txn = [e for e in entries if e.transactional]
        if txn:
            for row_id in self.store.cancel_requested([e.ctx.row_id for e in txn]):
                self._cancel(next(e for e in txn if e.ctx.row_id == row_id))

    def _lost(self, e: Running, why: str) -> None:
        if not e.ctx.cancelled.is_set():
            e.ctx.cancelled.set()
            event(
                log,
                logging.WARNING,
                "lease_lost",
                why,
                row_id=e.ctx.row_id,
                family=e.ctx.family,
                command=e.ctx.command,
                actor=e.ctx.actor,
                attempt=e.ctx.attempt,
            )

    def _cancel(self, e: Running) -> None:
        if not e.ctx.cancelled.is_set():
            e.cancel_requested = True
            e.ctx.cancelled.set()
            event(
                log,
                logging.INFO,
                "cancel_seen",
                "handler asked to stop: row was cancelled",
                row_id=e.ctx.row_id,
                family=e.ctx.family,
                command=e.ctx.command,
                actor=e.ctx.actor,
                attempt=e.ctx.attempt,
            )


def _overdue(e: Running, now: float) -> bool:
    return e.deadline is not None and now >= e.deadline and not e.ctx.cancelled.is_set()
