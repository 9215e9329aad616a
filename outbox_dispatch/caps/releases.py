"""Cap slot releases on the delivery path, sent to Redis without waiting for the answer.

A delivered row's slot is released when its handler returns (a cap counts running handlers;
its settle follows, deferred). The answer only says whether to wake the claimer, so it is read
later: with the next write (what has arrived), or at the end of the message (everything).
Redis runs commands in the order they arrive, so a write takes effect once Redis has read it,
whoever reads the answer. An answer lost with the connection loses nothing: a slot not
released expires with its lease.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import event, mask_dsn

if TYPE_CHECKING:
    from outbox_dispatch.caps.semaphore import Caps, Slot

log = logging.getLogger(__name__)


# A claimer to wake: (family, database; None for the first)
Wake = tuple[str, str | None]


@dataclass(frozen=True)
class Sent:
    """One script run of releases (one family's slots) whose answer is not read yet."""

    slots: tuple[Slot, ...]
    database: str | None = None  # whose claimer to wake


def runs(slots: Sequence[tuple[Slot, str | None]]) -> list[Sent]:
    """Releases grouped into script runs, one per (family, database), in first-seen order."""
    groups: dict[tuple[str, str | None], list[Slot]] = {}
    for slot, database in slots:
        groups.setdefault((slot.family, database), []).append(slot)
    return [Sent(tuple(group), database) for (_, database), group in groups.items()]


class PipelinedSlotWrites:
    """One process's unwaited slot releases on one connection; thread-safe."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self._lock = ForkSafeLock()
        # redis-py's Connection (its methods carry no type hints): written to, read later
        self._conn: Any = None
        self._pid = 0
        self._sent: collections.deque[Sent] = collections.deque()  # answers not read yet

    def release(self, slots: Sequence[Slot], database: str | None, *, wait: bool) -> set[Wake]:
        """Send the releases of ``slots``; return the claimers to wake, as (family, database)
        (answers of every database of the process ride together), from the answers read now:
        all of them with ``wait``, else those already here."""
        return self._write([(s, database) for s in slots], wait)

    def _write(self, slots: list[tuple[Slot, str | None]], wait: bool) -> set[Wake]:
        with self._lock:
            if not slots and not self._sent:
                return set()
            try:
                conn = self._connection()
                if slots:
                    self._send(conn, slots)
                return self._read(conn, wait)
            except redis.RedisError as exc:
                self._lost(exc)
                return set()

    def _send(self, conn: Any, slots: list[tuple[Slot, str | None]]) -> None:
        """Write ``slots``' releases, a script run per (family, database); called with the
        lock held. Their answers are read later (``_read``)."""
        writes = runs(slots)
        self._sent.extend(writes)  # counted as lost by ``_lost`` if the write fails
        commands = [self._command(w) for w in writes]
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)

    def _lost(self, exc: redis.RedisError) -> None:
        """A write or read failed: the connection goes, with every answer not read yet."""
        lost = sum(len(w.slots) for w in self._sent)
        self._drop()
        event(
            log,
            logging.WARNING,
            "cap_write_failed",
            f"{type(exc).__name__}: {mask_dsn(str(exc))}; up to {lost} slot releases "
            "lost: those slots free when their leases end",
        )

    def _command(self, w: Sent) -> tuple[Any, ...]:
        keys, args = self.caps.release_call(w.slots, w.database)
        return ("EVALSHA", self.caps.script_sha("release"), len(keys), *keys, *args)

    def _read(self, conn: Any, wait: bool) -> set[Wake]:
        """The answers in the order the writes were sent: every one with ``wait``, else those
        already arrived (no wait)."""
        woken: set[Wake] = set()
        while self._sent and (wait or conn.can_read(timeout=0)):
            w = self._sent.popleft()
            family = w.slots[0].family
            try:
                answer = int(conn.read_response())
            except redis.exceptions.NoScriptError:
                # Redis lost its scripts (SCRIPT FLUSH, a failover): this one runs again the
                # waited way, which loads the script; those sent after it answer the same
                answer = int(self.caps.release(w.slots, w.database))
            except redis.exceptions.ResponseError as exc:
                event(log, logging.WARNING, "cap_write_failed", str(exc), family=family)
                continue
            if answer == 1:
                woken.add((family, w.database))
        return woken

    def _connection(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # a forked child never touches its parent's socket: it opens its own
            self._sent.clear()
            client = self.caps.client  # registers the scripts
            conn: Any = client.connection_pool.make_connection()
            conn.connect()
            conn.send_command("SCRIPT", "LOAD", self.caps.script_text("release"))
            conn.read_response()
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _drop(self) -> None:
        self._sent.clear()
        if self._conn is not None and self._pid == os.getpid():
            self._conn.disconnect()
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
