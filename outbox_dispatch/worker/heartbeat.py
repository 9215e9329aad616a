"""Lease heartbeats for running handlers: one thread per process renews, every third of the
family's heartbeat timeout, the leases (and cap slots) of every handler still running, and
tells a handler to stop, with the reason, when it must. Short handlers finish before their
first renewal, so they cost a dict insert and delete.

Entries are keyed by (row id, claim token): in a threads pool a stale attempt and the
re-claim of its row can run in one process, and one must not end the other's heartbeat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any
from uuid import UUID

from outbox_dispatch.core import timings
from outbox_dispatch.core.errors import DatabaseUnavailable, OutboxError
from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.handlers import Context
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.settle import StopReason
from outbox_dispatch.core.validation import DEFAULT_PAYLOAD_LIMIT, encode_payload
from outbox_dispatch.store import Store

log = logging.getLogger(__name__)


Key = tuple[int, UUID]


class SlotState(Enum):
    HELD = "held"  # renewed: renew the row's lease too
    UNKNOWN = "unknown"  # Redis unreachable, the slot still runs: leave the row's lease as is
    LAPSED = "lapsed"  # gone, or about to run out unrenewed: the attempt must stop


@dataclass
class Running:
    ctx: Context
    token: UUID
    run_lease: float  # the family's heartbeat timeout: each renewal extends the lease this far
    renew_slot: Callable[[], SlotState] | None
    next_at: float
    progress: str | None = None  # JSON text, encoded when the handler gave it
    stop: StopReason | None = None
    holds: bool = True  # False once the lease is not renewed any more (lost, lapsed, overrun)
    soft_deadline: float | None = None  # monotonic: past it the handler is told to stop
    deadline: float | None = None  # monotonic: past it the lease is not renewed any more
    # gives the cap slot back: called when a renewal finds the claim lost, since the slot was
    # renewed just before (slots go first) and the row is the next claim's
    release_slot: Callable[[], None] | None = None

    @property
    def key(self) -> Key:
        return (self.ctx.row_id, self.token)

    def stop_reason(self, now: float | None = None) -> StopReason | None:
        """Why this attempt must not count as delivered, if it must not: the flag the
        heartbeat set, or a time limit that passed since its last tick."""
        if self.stop is not None:
            return self.stop
        at = time.monotonic() if now is None else now
        if self.soft_deadline is not None and at >= self.soft_deadline:
            return StopReason.TIME_LIMIT
        return None


class Heartbeats:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._running: dict[Key, Running] = {}
        self._lock = ForkSafeLock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(self, entry: Running) -> None:
        with self._lock:
            self._running[entry.key] = entry
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, name="outbox-heartbeat", daemon=True
                )
                self._thread.start()

    def remove(self, entry: Running) -> None:
        with self._lock:
            if self._running.get(entry.key) is entry:
                del self._running[entry.key]

    def running(self, key: Key) -> Running | None:
        with self._lock:
            return self._running.get(key)

    def beat_now(self, key: Key, progress: Any = None) -> bool:
        """A handler's own ``ctx.heartbeat()``: renew at once; False if it must stop.
        Progress that jsonb cannot hold is refused here, before it is kept: every renewal of
        the entry sends it, so kept, it would fail them all and the lease would lapse while the
        handler runs (and with it every lease renewed in the same statement)."""
        entry = self.running(key)
        if entry is None:
            return False
        if progress is not None:
            # kept as text: a value the handler changes afterwards cannot fail a renewal
            entry.progress = encode_payload(progress, DEFAULT_PAYLOAD_LIMIT, "heartbeat progress")
        self._renew([entry])
        return not entry.ctx.cancelled.is_set()

    def _loop(self) -> None:
        while True:
            time.sleep(timings.HEARTBEAT_TICK)
            now = time.monotonic()
            with self._lock:
                due = [e for e in self._running.values() if e.next_at <= now or _overdue(e, now)]
            if due:
                try:
                    self._renew(due)
                except Exception as exc:  # Postgres unreachable: try again next tick
                    for e in due:
                        e.next_at = time.monotonic() + timings.HEARTBEAT_TICK
                    # anything else is a bug of ours: never let it end the thread, which
                    # renews every lease of this process
                    if isinstance(exc, DatabaseUnavailable):  # said once an outage
                        self.store.outage.failed("lease renewal", str(exc))
                        continue
                    known = isinstance(exc, OutboxError)
                    level = logging.WARNING if known else logging.ERROR
                    event(log, level, "heartbeat_failed", str(exc) if known else repr(exc))

    def _renew(self, entries: list[Running]) -> None:
        now = time.monotonic()
        by_lease: dict[float, list[Running]] = {}
        for e in entries:
            e.next_at = now + e.run_lease / 3
            if not e.holds:
                continue  # no longer a holder: its lease runs out
            if e.deadline is not None and now >= e.deadline:
                # not renewed any more: the lease runs out and the row is claimed again, even
                # when the pool cannot interrupt the handler (threads)
                self._stop(e, StopReason.TIME_LIMIT, holds=False)
                continue
            if e.soft_deadline is not None and now >= e.soft_deadline:
                self._stop(e, StopReason.TIME_LIMIT)
            if e.renew_slot is not None:
                state = e.renew_slot()
                if state is SlotState.LAPSED:
                    self._stop(e, StopReason.SLOT_LAPSED, holds=False)
                    continue
                if state is SlotState.UNKNOWN:
                    continue  # the row's lease must not outlive a slot that cannot be renewed
            by_lease.setdefault(e.run_lease, []).append(e)
        for lease, group in by_lease.items():
            held = self.store.renew([(e.ctx.row_id, e.token, e.progress) for e in group], lease)
            for e in group:
                if e.ctx.row_id not in held:
                    if self.running(e.key) is e:  # not a settle that just finished
                        self._stop(e, StopReason.CLAIM_LOST, holds=False)
                        self._give_back_slot(e)
                elif held[e.ctx.row_id]:
                    self._stop(e, StopReason.CANCEL_REQUESTED)

    def _give_back_slot(self, e: Running) -> None:
        """A lost claim's cap slot, renewed a moment ago, goes back: otherwise the claim that
        takes the row again sees a holder its heartbeat just renewed and keeps the slot for a
        whole heartbeat timeout."""
        if e.release_slot is None:
            return
        try:
            e.release_slot()
        except Exception as exc:  # Redis unreachable: the slot runs out on its own
            event(log, logging.WARNING, "slot_release_failed", repr(exc), row_id=e.ctx.row_id)

    def _stop(self, e: Running, reason: StopReason, *, holds: bool = True) -> None:
        """Tell the handler to stop. Its return is judged by the first reason, except that
        any other reason outranks a cancel request (their retry settle honours the cancel
        anyway). ``holds=False``: the lease is not renewed any more."""
        if not holds:
            e.holds = False
        if e.stop is None or (
            e.stop is StopReason.CANCEL_REQUESTED and reason is not StopReason.CANCEL_REQUESTED
        ):
            e.stop = reason
            e.ctx.cancelled.set()
            cancel = reason is StopReason.CANCEL_REQUESTED
            event(
                log,
                logging.INFO if cancel else logging.WARNING,
                "cancel_seen" if cancel else "handler_stopped",
                f"handler told to stop: {reason.value}"
                + ("" if holds else "; its lease is not renewed any more"),
                row_id=e.ctx.row_id,
                family=e.ctx.family,
                command=e.ctx.command,
                actor=e.ctx.actor,
                attempt=e.ctx.attempt,
            )


def _overdue(e: Running, now: float) -> bool:
    """A time limit passed that was not acted on yet."""
    if not e.holds:
        return False
    soft = e.soft_deadline is not None and now >= e.soft_deadline and e.stop is None
    return soft or (e.deadline is not None and now >= e.deadline)
