"""Cap slot releases written to Redis without waiting for its answer.

A delivered row's slot goes back right after the statement that settled it, before the next
handler of the pool process runs. Waiting for Redis's answer there cost a capped row about
0.2 ms of its pool process on two busy cores (the round trip and the wake-ups on both sides),
while the answer only says whether to wake the claimer. So a release on the delivery path is
written to a connection of its own and its answer read later: with the next release (what has
arrived), or at the end of the message and by the settles' thread (everything). Redis runs
commands in the order they arrive, so the slot is free as soon as Redis has read the release,
whoever reads the answer. An answer lost with the connection loses nothing: that slot was
either freed or expires with its lease, as after any failed release.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from .forksafe import ForkSafeLock
from .logs import event, mask_dsn

if TYPE_CHECKING:
    from .caps import Caps, Slot

log = logging.getLogger(__name__)

Sent = tuple["Slot", str | None]  # a release written, its answer not read: (slot, database)


class PipelinedReleases:
    """One process's releases on one connection; thread-safe (the settles' thread and the
    delivery path both release)."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self._lock = ForkSafeLock()
        # redis-py's Connection (its methods carry no type hints): written to, read later
        self._conn: Any = None
        self._pid = 0
        self._sent: collections.deque[Sent] = collections.deque()  # answers not read yet

    def release(self, slots: Sequence[Slot], database: str | None, *, wait: bool) -> set[str]:
        """Send the releases of ``slots``; return the families whose claimer should be woken,
        from the answers read now: all of them with ``wait``, else those already here."""
        with self._lock:
            if not slots and not self._sent:
                return set()
            try:
                conn = self._connection()
                if slots:
                    sha = self.caps.script_sha("release")
                    commands = []
                    for s in slots:
                        keys = self.caps.release_keys(s.family, s.actor, s.scope, database)
                        args = [str(s.token), s.actor, self.caps.wake_ms]
                        commands.append(("EVALSHA", sha, len(keys), *keys, *args))
                    # counted as lost below if the write fails
                    self._sent.extend((s, database) for s in slots)
                    conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                return self._read(conn, wait)
            except redis.RedisError as exc:
                lost = len(self._sent)
                self._drop()
                event(
                    log,
                    logging.WARNING,
                    "cap_release_failed",
                    f"{type(exc).__name__}: {mask_dsn(str(exc))}; up to {lost} slots free when "
                    "their leases end",
                )
                return set()

    def _read(self, conn: Any, wait: bool) -> set[str]:
        """The answers in the order the releases were sent: every one with ``wait``, else
        those already arrived (no wait)."""
        woken: set[str] = set()
        while self._sent and (wait or conn.can_read(timeout=0)):
            slot, database = self._sent.popleft()
            try:
                wake = int(conn.read_response()) == 1
            except redis.exceptions.NoScriptError:
                # Redis lost its scripts (SCRIPT FLUSH, a failover): this one runs again as a
                # one-slot release, which loads the script; those sent after it answer the same
                wake = self.caps.release(slot.family, slot.actor, slot.token, slot.scope, database)
            except redis.exceptions.ResponseError as exc:
                event(log, logging.WARNING, "cap_release_failed", str(exc), family=slot.family)
                continue
            if wake:
                woken.add(slot.family)
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
