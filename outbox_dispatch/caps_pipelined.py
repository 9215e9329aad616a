"""Cap slot releases on the delivery path, sent to Redis without waiting for the answer.

A delivered row's slot is released when its handler returns (a cap counts running handlers;
its settle follows, deferred). Waiting for the answer cost a capped row about 0.2 ms of its
pool process on two busy cores, and the answer only says whether to wake the claimer.

A release is held back, unsent, until the next row's start (before its handler runs) or the
end of the message writes it, with any others held: each write costs the pool process a
system call and a wake-up of Redis. (A start used to renew its row's slot here too, to bound
it to the heartbeat timeout; the claim that finds the row's lease run out gives the slot back
instead, claim_lapsed_holders.)

Answers are read later: with the next write (what has arrived), or at the end of the message
and by the settles' thread (everything). Redis runs commands in the order they arrive, so a
write takes effect once Redis has read it, whoever reads the answer. An answer lost with the
connection loses nothing: a slot not released expires with its lease.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from .forksafe import ForkSafeLock
from .logs import event, mask_dsn

if TYPE_CHECKING:
    from .caps import Caps, Slot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sent:
    """A release whose answer is not read yet."""

    slot: Slot
    database: str | None = None  # whose claimer to wake


class PipelinedSlotWrites:
    """One process's unwaited slot releases on one connection; thread-safe (the settles'
    thread, the delivery path and the claimer all write)."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self._lock = ForkSafeLock()
        # redis-py's Connection (its methods carry no type hints): written to, read later
        self._conn: Any = None
        self._pid = 0
        self._sent: collections.deque[Sent] = collections.deque()  # answers not read yet
        self._held: list[Sent] = []  # releases not written yet: the next write carries them
        self._held_pid = 0

    def hold(self, slots: Sequence[Slot], database: str | None) -> None:
        """Keep the releases of ``slots`` for the next write (no I/O): see ``send_held``."""
        with self._lock:
            if self._held_pid != os.getpid():
                self._held.clear()  # a forked child never sends its parent's
                self._held_pid = os.getpid()
            self._held += [Sent(s, database) for s in slots]

    def send_held(self) -> set[str]:
        """Write the held releases, if any are left; the families to wake, as ``release``."""
        if not self._held:
            return set()
        return self._write([], False)

    def release(self, slots: Sequence[Slot], database: str | None, *, wait: bool) -> set[str]:
        """Send the releases of ``slots``; return the families whose claimer should be woken,
        from the answers read now: all of them with ``wait``, else those already here."""
        return self._write([Sent(s, database) for s in slots], wait)

    def _write(self, writes: list[Sent], wait: bool) -> set[str]:
        with self._lock:
            if self._held and self._held_pid == os.getpid():
                writes = self._held + writes
            self._held = []
            if not writes and not self._sent:
                return set()
            try:
                conn = self._connection()
                if writes:
                    self._sent.extend(writes)  # counted as lost below if the write fails
                    commands = [self._command(w) for w in writes]
                    conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                return self._read(conn, wait)
            except redis.RedisError as exc:
                lost = len(self._sent)
                self._drop()
                event(
                    log,
                    logging.WARNING,
                    "cap_write_failed",
                    f"{type(exc).__name__}: {mask_dsn(str(exc))}; up to {lost} slot releases "
                    "lost: those slots free when their leases end",
                )
                return set()

    def _command(self, w: Sent) -> tuple[Any, ...]:
        s = w.slot
        keys = self.caps.release_keys(s.family, s.actor, s.scope, w.database)
        args = [str(s.token), s.actor, self.caps.wake_ms]
        return ("EVALSHA", self.caps.script_sha("release"), len(keys), *keys, *args)

    def _read(self, conn: Any, wait: bool) -> set[str]:
        """The answers in the order the writes were sent: every one with ``wait``, else those
        already arrived (no wait)."""
        woken: set[str] = set()
        while self._sent and (wait or conn.can_read(timeout=0)):
            w = self._sent.popleft()
            s = w.slot
            try:
                answer = int(conn.read_response())
            except redis.exceptions.NoScriptError:
                # Redis lost its scripts (SCRIPT FLUSH, a failover): this one runs again the
                # waited way, which loads the script; those sent after it answer the same
                answer = int(self.caps.release(s.family, s.actor, s.token, s.scope, w.database))
            except redis.exceptions.ResponseError as exc:
                event(log, logging.WARNING, "cap_write_failed", str(exc), family=s.family)
                continue
            if answer == 1:
                woken.add(s.family)
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
