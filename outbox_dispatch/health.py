"""Whether a database answers, as this process last saw it: with several databases, one that
stops answering must not cost the others anything. New work for it (claims, delivery starts,
claim requests) fails at once while it is down, instead of each call waiting out the pool's
timeout in a worker process the other databases' rows need; a call after the back-off probes
it again. Work already running (heartbeats, settles) still waits for it, since giving up there
would run a finished row again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .errors import DatabaseUnavailable

FIRST_BACKOFF = 1.0  # seconds new work waits after a failure before one call probes again
MAX_BACKOFF = 10.0
PROBE_TIMEOUT = 2.0  # seconds a probe waits for a pool connection before it counts as down
# seconds new work waits for a pool connection while the database is up: far above what a busy
# pool makes anyone wait for a few-millisecond statement, far below the pool's own 30 s that a
# worker process starting while the database is down would otherwise lose per database
NEW_WORK_TIMEOUT = 3.0


class Breaker:
    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._probing = False
        self.last_error = ""

    @property
    def down(self) -> bool:
        return self._backoff > 0

    def admit(self) -> float:
        """Let a new piece of work through, returning how long it may wait for a connection;
        raises DatabaseUnavailable while the database is in its back-off or another call is
        probing it."""
        with self._lock:
            if not self._backoff:
                return NEW_WORK_TIMEOUT
            if self._probing or self.clock() < self._down_until:
                raise DatabaseUnavailable(
                    f"database {self.name!r} is not answering ({self.last_error}); its rows wait "
                    "until it is back, the other databases go on",
                    repeated=True,
                )
            self._probing = True
            return PROBE_TIMEOUT

    def succeeded(self) -> None:
        if self._backoff or self._probing:
            with self._lock:
                self._backoff = 0.0
                self._probing = False

    def failed(self, error: str) -> None:
        with self._lock:
            self._backoff = min(MAX_BACKOFF, self._backoff * 2 or FIRST_BACKOFF)
            self._down_until = self.clock() + self._backoff
            self._probing = False
            self.last_error = error
