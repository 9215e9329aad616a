"""Local hand-off: the worker whose commit listener claimed rows runs them itself when it has
room, so their messages skip the broker.

Every message through the broker costs the worker's main thread a fetch and two synchronous
round trips to Redis (kombu records it as unacknowledged, then acknowledges it) besides the
claimer's publish; at low load each of those is a wake-up of an idle process, and together
they were most of the time from commit to handler start. A claim made by this worker's
commit listener gives its first messages to this worker's own Celery consumer instead, as
many as the worker would prefetch from the broker (its pool processes times the prefetch
multiplier, less the requests it holds: with the default of one, as many as it has idle
processes), and publishes the rest, which the broker spreads over every worker. The message
is the one the broker would carry, received as if it had just arrived:
the same task, request, events (Flower), time limits and acknowledgement rules; it only waits
in this worker's memory instead of in Redis.

For a crash it is a prefetched broker message: the row's lease is the safety net (a message
of a worker killed with -9 is not redelivered before Redis' visibility timeout either). A
handed-off message that Celery rejects for requeue (its pool process died: acks_late with
reject_on_worker_lost), or that has not started when this worker's consumer stops (a warm
shutdown, a lost broker connection), is published to the broker then, as kombu restores its
unacknowledged messages, so another worker runs it at once; if it started meanwhile, the
published copy is refused as stale by the claim token. When that publish fails too (the
broker is what went away), the messages wait here and run when the consumer starts again.

Not handed off: messages of queues this worker does not consume, and any message while
something listens to Celery's publish signals or asked for task-sent events (the publisher
takes Celery's own path then, so nothing they rely on is skipped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kombu.message import Message

from .forksafe import ForkSafeLock
from .logs import event
from .policy import FeedBasis, local_feed
from .publisher import Wire

log = logging.getLogger(__name__)

QUEUES_TTL = 1.0  # seconds the consumed queues are reused (workers can add or cancel queues)


class _LocalChannel:
    """What kombu's Message asks of a channel: the acknowledgement of a handed-off message
    goes back to the hand-off, never to the broker."""

    no_ack_consumers = None

    def __init__(self, handoff: LocalHandoff) -> None:
        self.handoff = handoff

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        self.handoff.finished(delivery_tag)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self.handoff.rejected(delivery_tag, requeue)


class LocalHandoff:
    """Gives delivery messages to this worker's Celery consumer (see the module docstring).

    ``take`` runs in any thread of the worker's main process (the commit listener's);
    everything that touches Celery runs in the consumer's event loop thread, woken through a
    socket pair."""

    def __init__(self, republish: Callable[[str, Sequence[Wire]], None]) -> None:
        self.republish = republish  # to the broker: rejected for requeue, or not started at stop
        # new in a forked pool process, which may take it (a claim task there hands nothing
        # off), while a listener thread of the worker held it at the fork
        self._lock = ForkSafeLock()
        self._pending: deque[tuple[str, Wire]] = deque()  # taken, not yet given to Celery
        self._outstanding: dict[str, tuple[str, Wire]] = {}  # given, not yet acked or rejected
        self._giving = 0  # taken from _pending by the loop, not yet reserved by Celery
        self._consumer: Any = None
        self._handler: Callable[[Message], None] | None = None
        self._pid = 0
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._queues: frozenset[str] = frozenset()
        self._queues_at = 0.0
        self.handed = 0  # messages given to this worker since it started (tests, metrics)

    # -- the consumer's side (its event loop thread) ----------------------------------------

    def attach(self, consumer: Any) -> None:
        """Start taking messages for ``consumer`` (a consumer bootstep's start)."""
        hub = getattr(consumer, "hub", None)
        if hub is None:  # a consumer without an event loop: everything goes through the broker
            return
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        handler = consumer.create_task_handler()
        with self._lock:
            self._wake = (reader, writer)
            self._consumer, self._handler, self._pid = consumer, handler, os.getpid()
            self._queues_at = 0.0
        hub.add_reader(reader, self._drain)
        with self._lock:
            waiting = bool(self._pending)
        if waiting:  # kept from a stop whose publish failed: run them now
            with contextlib.suppress(OSError):
                writer.send(b"\0")

    def detach(self) -> None:
        """Stop taking messages (a consumer bootstep's stop): what was taken and has not
        started is published to the broker; what is running stays known, so that it is
        published if Celery gives it back (its pool process died)."""
        running = _active_ids()
        with self._lock:
            consumer, wake = self._consumer, self._wake
            self._consumer = self._handler = self._wake = None
            waiting = list(self._pending)
            self._pending.clear()
            waiting += [m for tag, m in self._outstanding.items() if tag not in running]
            # a running one is still published if its pool process dies (rejected)
            self._outstanding = {t: m for t, m in self._outstanding.items() if t in running}
        if wake is not None:
            hub = getattr(consumer, "hub", None)
            if hub is not None:
                hub.remove_reader(wake[0])
            for sock in wake:
                sock.close()
        self._republish(waiting, "the worker's consumer stopped before they started", keep=True)

    def _drain(self) -> None:
        """Give the taken messages to Celery, as its broker consumer gives a received one.
        The wake-ups are read before the messages are: a message taken after that sent its
        wake-up after it, so this loop runs again for it (read after, a wake-up sent between
        the two would be read with no message left behind it to wake for, and the message
        would wait for the next take, which may never come: its row then waited its lease)."""
        with self._lock:
            wake = self._wake
        if wake is not None:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while wake[0].recv(4096):
                    pass
        with self._lock:
            handler = self._handler
            batch = list(self._pending)
            self._pending.clear()
            # still this worker's to hold, for a take meanwhile, until Celery reserves each
            self._giving = len(batch) if handler is not None else 0
        if handler is None:
            self._republish(batch, "the worker's consumer stopped before they started", keep=True)
            return
        channel = _LocalChannel(self)
        for queue, wire in batch:
            with self._lock:
                self._outstanding[wire.task_id] = (queue, wire)
            try:
                handler(_message(wire, queue, channel))
            except Exception as exc:  # never break the consumer's loop: the broker takes it
                with self._lock:
                    self._outstanding.pop(wire.task_id, None)
                self._republish([(queue, wire)], f"could not be received here ({exc!r})")
            finally:
                with self._lock:
                    self._giving -= 1

    # -- the message's acknowledgement ------------------------------------------------------

    def finished(self, tag: str) -> None:
        with self._lock:
            self._outstanding.pop(tag, None)

    def rejected(self, tag: str, requeue: bool) -> None:
        with self._lock:
            message = self._outstanding.pop(tag, None)
        if requeue and message is not None:
            self._republish([message], "rejected for requeue (its pool process died)")

    def _republish(self, messages: list[tuple[str, Wire]], why: str, *, keep: bool = False) -> None:
        """Publish to the broker what this worker will not run. ``keep``: the consumer stopped,
        and what cannot be published waits here for its next start (the broker is what went
        away); otherwise the rows' leases bring them back (a message kept while the consumer
        runs would count against its room and never be woken)."""
        by_queue: dict[str, list[Wire]] = {}
        for queue, wire in messages:
            by_queue.setdefault(queue, []).append(wire)
        for queue, wires in by_queue.items():
            try:
                self.republish(queue, wires)
            except Exception as exc:
                if keep:
                    with self._lock:
                        self._pending.extend((queue, w) for w in wires)
                event(
                    log,
                    logging.WARNING,
                    "handoff_republish_failed",
                    f"{len(wires)} handed-off messages of {queue} {why}, and could not be "
                    f"published ({exc!r}); "
                    + (
                        "they wait for this worker's consumer to start again, else their "
                        "rows are claimed again after their lease"
                        if keep
                        else "their rows are claimed again after their lease"
                    ),
                )
            else:
                event(
                    log,
                    logging.INFO,
                    "handoff_republished",
                    f"{len(wires)} handed-off messages of {queue} {why}: published to the broker",
                )

    # -- the claimer's side (any thread of this process) ------------------------------------

    def take(
        self,
        queue: str,
        wires: Sequence[Wire],
        *,
        idle: bool = False,
        feed: FeedBasis | None = None,
    ) -> int:
        """Keep the first of ``wires`` this worker has room for; returns how many. Room: what
        it would prefetch from the broker (its pool processes times the prefetch multiplier,
        one by default), less the requests it already holds, so that a handed-off message
        never waits here while another worker could run it. ``idle`` (rows handed over
        unclaimed): only as many as there are pool processes that run nothing. Such a row
        waiting here would be better claimed and sent to a free process. Rows allowed to wait
        behind short handlers were measured: under load they waited past their hold
        (handed.py), and the claims took them and their starts were dropped. ``feed``
        (claimed one-row messages): more, the worker's share of the claim, so long as what
        waits here stays a fraction of a second of its processes' work (policy.local_feed)."""
        if self._pid != os.getpid():  # a forked pool process (a claim task): never attached here
            return 0
        with self._lock:
            if self._wake is None or queue not in self._consumed():
                return 0
            held = self._held()
            room = self._prefetch() - held
            if idle:
                room = self._processes() - held
            elif feed is not None:
                waiting = len(self._pending) + self._giving + len(self._outstanding)
                room = max(room, local_feed(feed, self._processes(), len(wires), waiting))
            taken = list(wires[: max(0, room)])
            if not taken:
                return 0
            self._pending.extend((queue, w) for w in taken)
            self.handed += len(taken)
            writer = self._wake[1]
        # a full socket holds wake-ups enough: the loop will drain; a closed one was closed
        # by a detach, which published what this took (it was pending when the detach took
        # the lock), so the claim goes on publishing the rest
        with contextlib.suppress(OSError):
            writer.send(b"\0")
        return len(taken)

    def held(self) -> int:
        """The messages this worker holds: Celery's requests (waiting for a pool process or
        running) and those taken here that Celery has not received yet."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return _reserved() + len(self._pending) + self._giving

    def _consumed(self) -> frozenset[str]:
        """The queues this worker consumes (called with the lock held)."""
        now = time.monotonic()
        if now - self._queues_at > QUEUES_TTL:
            task_consumer = getattr(self._consumer, "task_consumer", None)
            queues = getattr(task_consumer, "queues", None) or ()
            self._queues = frozenset(q.name for q in queues)
            self._queues_at = now
        return self._queues

    def _prefetch(self) -> int:
        """The requests this worker holds at most: its prefetch count (called with the lock
        held); without one, its pool processes."""
        qos = getattr(self._consumer, "qos", None)
        value = getattr(qos, "value", None)
        if isinstance(value, int) and value > 0:
            return value
        return self._processes()

    def _processes(self) -> int:
        """This worker's pool processes (or threads)."""
        pool = getattr(self._consumer, "pool", None)
        return max(1, int(getattr(pool, "num_processes", None) or 1))


def _message(wire: Wire, queue: str, channel: _LocalChannel) -> Message:
    """The kombu message Celery's consumer would have received for ``wire``."""
    delivery_info = {"exchange": "", "routing_key": queue, "redelivered": False}
    return Message(  # type: ignore[no-untyped-call]
        body=wire.body.encode(),
        delivery_tag=wire.task_id,
        content_type="application/json",
        content_encoding="utf-8",
        delivery_info=delivery_info,
        properties=dict(wire.properties),
        headers=wire.headers,
        channel=channel,
    )


def _reserved() -> int:
    """Requests this worker holds: waiting for a pool process or running."""
    from celery.worker import state

    return len(state.reserved_requests)


def _active_ids() -> set[str]:
    from celery.worker import state

    return {r.id for r in list(state.active_requests)}
