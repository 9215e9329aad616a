"""A worker that is stopped hands back the rows it holds, so a rolling deploy costs no lease.

Runs in the worker's main process (the one that consumes), which knows every delivery message
it received and did not finish. When a warm shutdown begins, the rows of those messages that
have not started are due again at once, uncounted, and their cap slots go back: otherwise they
wait for this worker's running handlers to end (the broker gets the messages back only when
the worker closes its connection), and a message reserved by a worker killed later waits out
its lease. When a cold shutdown has cut off the handlers still running (Celery's soft
shutdown, after ``worker_soft_shutdown_timeout``), their rows are marked lost at once (run
again, ``maybe_applied``), not left for the heartbeat timeout.

Postgres decides each row, so a row that a pool process starts at that very moment is either
started (and left to run) or handed back (and its start refused): never both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from outbox_dispatch.core.logs import event
from outbox_dispatch.store.connections import translated
from outbox_dispatch.worker.messages import parse_batch, parse_message
from outbox_dispatch.worker.slots import CapSlots, Handed

log = logging.getLogger(__name__)

# The most a stopping worker waits for its hand back (Postgres slow or down): past it the rows
# wait for their leases, as they would have anyway.
HAND_BACK_WAIT = 10.0

Pairs = list[tuple[int, UUID]]


def message_rows(args: Any) -> tuple[str | None, Pairs]:
    """The database a delivery message names (None: the first) and its (id, token) pairs; no
    pairs for anything that is not a delivery message."""
    rest = tuple(args) if isinstance(args, list | tuple) else ()
    name = None
    if rest and isinstance(rest[0], str):  # databases.split_message: a database's name first
        name, rest = rest[0], rest[1:]
    pair = parse_message(rest)
    return name, [pair] if pair is not None else parse_batch(rest) or []


class Leaving:
    """The delivery messages this process received and has not acknowledged yet, and what
    becomes of their rows when the worker stops. ``slots_of(database)`` is that database's
    CapSlots (its store, its caps and its claimer's wake), None if it has none."""

    def __init__(self, slots_of: Callable[[str | None], CapSlots | None]) -> None:
        self.slots_of = slots_of
        # Celery request id -> its Request. No lock: the consumer's thread adds to it, and
        # Celery's signal handler reads it on that same thread, between two of its statements.
        self._held: dict[str, Any] = {}
        self._consumer: Any = None  # Celery's Consumer, which received them
        self._prune_at = 64
        self._leaving = False  # a warm shutdown began
        self._threads: list[threading.Thread] = []

    def received(self, request: Any, consumer: Any) -> None:
        """A delivery message was received (Celery's ``task_received``). Acknowledged messages
        are dropped as more come in, so this holds about what the worker has reserved. One
        that arrives after a warm shutdown began (the broker had sent it already) goes back at
        once."""
        self._consumer = consumer
        if self._leaving:
            name, pairs = message_rows(getattr(request, "args", None))
            if pairs:
                self._start({name: pairs}, cold=False)
            return
        self._held[request.id] = request
        if len(self._held) >= self._prune_at:
            self._held = {k: r for k, r in self._held.items() if not r.acknowledged}
            self._prune_at = max(64, 2 * len(self._held))

    def unfinished(self) -> dict[str | None, Pairs]:
        """The rows of the messages not acknowledged, by database."""
        requests = [r for r in list(self._held.values()) if not r.acknowledged]
        out: dict[str | None, Pairs] = {}
        for request in requests:
            name, pairs = message_rows(getattr(request, "args", None))
            out.setdefault(name, []).extend(pairs)
        return out

    def stopping(self, *, cold: bool) -> None:
        """A shutdown began (warm), or a cold one cancelled the tasks still running: hand the
        rows back from a thread (this runs in Celery's signal handler). A cold shutdown waits
        for it, since the process exits right after."""
        if not cold:  # a cold shutdown stopped taking messages before it cancelled the tasks
            self._leaving = True
        rows = self.unfinished()
        if not rows:
            return
        if not cold:
            self._stop_consuming()
        thread = self._start(rows, cold=cold)
        if cold:
            thread.join(HAND_BACK_WAIT)

    def _start(self, rows: dict[str | None, Pairs], *, cold: bool) -> threading.Thread:
        thread = threading.Thread(
            target=self._hand_back, args=(rows, cold), name="outbox-leaving", daemon=True
        )
        self._threads.append(thread)
        thread.start()
        return thread

    def _stop_consuming(self) -> None:
        """The rows handed back are claimed again at once, and this worker must not take their
        new messages: it stops taking messages now, as its shutdown does a moment later (the
        consumer's ``task_consumer``, cancelled as Celery's cold shutdown cancels it)."""
        task_consumer = getattr(self._consumer, "task_consumer", None)
        if task_consumer is None:
            return
        try:
            task_consumer.cancel()
        except Exception as exc:  # the broker is gone: no message can come from it either
            event(log, logging.INFO, "consumer_cancel_failed", repr(exc))

    def stopped(self) -> None:
        """The worker has shut down: its hand backs must land before the process exits."""
        deadline = time.monotonic() + HAND_BACK_WAIT
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _hand_back(self, rows: dict[str | None, Pairs], lost: bool) -> None:
        for database, pairs in rows.items():
            slots = self.slots_of(database)
            if slots is None or not pairs:
                continue
            try:
                handed = hand_back(slots, pairs, lost=lost)
            except Exception as exc:  # Postgres down: the rows wait for their leases
                message = f"{len(pairs)} rows not handed back ({exc}): their leases bring them back"
                event(log, logging.WARNING, "hand_back_failed", message, database=database)
                continue
            given = sum(1 for h in handed if not h.started)
            cut = len(handed) - given
            if handed:
                event(
                    log,
                    logging.WARNING if cut else logging.INFO,
                    "handed_back",
                    f"worker stopping: {given} rows not started are due again now"
                    + (f", {cut} cut off while running are marked lost" if cut else ""),
                    database=database,
                    rows=sorted(h.id for h in handed),
                )


def hand_back(slots: CapSlots, pairs: Pairs, *, lost: bool) -> list[Handed]:
    """One statement for the rows (sql/shutdown.sql), then their cap slots go back and their
    families' claimers are woken."""
    store = slots.store
    params = {"ids": [i for i, _ in pairs], "tokens": [t for _, t in pairs], "lost": lost}
    with translated("hand back"), store.connection() as conn:
        found = conn.execute(store.q["shutdown_hand_back"], params).fetchall()
    handed = [Handed(int(r[0]), r[1], r[2], r[3], r[4], bool(r[5])) for r in found]
    slots.handed_back(handed)
    return handed
