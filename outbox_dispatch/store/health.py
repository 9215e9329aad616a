"""Whether a database answers, as this process last saw it: with several databases, one that
stops answering must not cost the others anything. New work for it (claims, delivery starts,
claim requests, status reads) fails at once while it is down, instead of each call waiting out
the pool's timeout in a worker process the other databases' rows need; after the back-off one
call, the probe, tries it again, and only the probe's outcome opens or closes the breaker (a
straggler admitted before the trip says nothing new). Work already running (heartbeats,
settles) still waits for it, since giving up there would run a finished row again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from outbox_dispatch.core.errors import DatabaseUnavailable
from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import event

log = logging.getLogger(__name__)
T = TypeVar("T")

# A fenced statement (a start, a settle) that finds the database not answering (a restart) is
# tried again, the waits growing from the first to the most, for at most PATIENCE seconds: its
# row goes on within RETRY_MOST of the database's return, not after its lease. Past it the
# error is the caller's, and the row's lease brings it back.
RETRY_FIRST = 0.25
RETRY_MOST = 1.0
PATIENCE = 60.0

FIRST_BACKOFF = 1.0  # seconds new work waits after a failure before one call probes again
MAX_BACKOFF = 10.0
PROBE_TIMEOUT = 2.0  # seconds a probe waits for a pool connection before it counts as down
# seconds new work waits for a pool connection before asking whether the database answers at
# all (a worker process starting while a database is down would otherwise lose the pool's own
# 30 s for it); when a connection of its own gets through, the pool is only busy, and the work
# waits for it as it would without a breaker
NEW_WORK_TIMEOUT = 3.0
PROBE_CONNECT_TIMEOUT = 2  # seconds that connection of its own may take (libpq: whole seconds)


# libpq settings of the pool's connections with several databases, where the URL does not
# set them: a database cut off without a hang-up (a silent partition) fails its statements in
# about ten seconds instead of hanging a claim pass (or a pool process) for the OS's minutes
LIVENESS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",  # ms
}


def liveness_options(url: str) -> dict[str, str]:
    """LIVENESS without what ``url`` sets itself."""
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(url)
    return {k: v for k, v in LIVENESS.items() if k not in given}


@dataclass(frozen=True)
class Admission:
    timeout: float  # how long this call may wait for a pool connection
    probe: bool  # this call tests a database that was down: its outcome decides


class Breaker:
    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self._lock = ForkSafeLock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._probing = False
        self.last_error = ""

    @property
    def down(self) -> bool:
        return self._backoff > 0

    def admit(self) -> Admission:
        """Let a new piece of work through; raises DatabaseUnavailable while the database is
        in its back-off or another call is probing it."""
        with self._lock:
            if not self._backoff:
                return Admission(NEW_WORK_TIMEOUT, probe=False)
            if self._probing or self.clock() < self._down_until:
                raise DatabaseUnavailable(
                    f"database {self.name!r} is not answering ({self.last_error}); its rows wait "
                    "until it is back, the other databases go on",
                    repeated=True,
                )
            self._probing = True
            return Admission(PROBE_TIMEOUT, probe=True)

    def succeeded(self, admission: Admission) -> None:
        """The database answered this call: a probe closes the breaker."""
        if admission.probe:
            with self._lock:
                self._backoff = 0.0
                self._probing = False

    def failed(self, admission: Admission, error: str) -> None:
        """The database did not answer: the first failure opens the breaker, a failed probe
        doubles the back-off; a straggler's failure while it is open changes nothing."""
        with self._lock:
            if self._backoff and not admission.probe:
                return
            self._backoff = min(MAX_BACKOFF, self._backoff * 2 or FIRST_BACKOFF)
            self._down_until = self.clock() + self._backoff
            self._probing = False
            self.last_error = error

    def abandoned(self, admission: Admission) -> None:
        """The call ended some other way (its own error, a time limit): a probe gives its turn
        back without deciding, so the next call after the back-off probes again."""
        if admission.probe:
            with self._lock:
                self._probing = False


class Outage:
    """What this process has said about its database being unreachable: one WARNING when an
    outage begins (a restart costs a few failed statements per process, not a line each) and
    one INFO line when the database answers again."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.since: float | None = None

    def failed(self, what: str, why: str) -> None:
        first = self.since is None
        if first:
            self.since = self.clock()
        event(
            log,
            logging.WARNING if first else logging.DEBUG,
            "database_unreachable",
            f"{what}: database {self.name!r} is not answering ({why}); waiting for it, "
            "no row is lost",
        )

    @property
    def on(self) -> bool:
        """Whether this process has failed to reach the database and not reached it since."""
        return self.since is not None

    def answered(self) -> None:
        if self.since is None:
            return
        took, self.since = self.clock() - self.since, None
        event(
            log,
            logging.INFO,
            "database_back",
            f"database {self.name!r} answers again after {took:.1f} s",
        )


def when_answering(
    call: Callable[[], T],
    outage: Outage,
    what: str,
    patience: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    at_once: tuple[type[DatabaseUnavailable], ...] = (),
) -> T:
    """``call()``, tried again while it fails with DatabaseUnavailable (but not ``at_once``),
    for ``patience`` seconds (PATIENCE). Only for statements fenced by a claim token: running
    one again cannot start or settle another claim's row."""
    deadline = outage.clock() + (PATIENCE if patience is None else patience)
    wait = RETRY_FIRST
    while True:
        try:
            return call()
        except DatabaseUnavailable as exc:
            if exc.repeated or isinstance(exc, at_once) or outage.clock() + wait > deadline:
                raise
            outage.failed(what, str(exc))
            sleep(wait)
            wait = min(wait * 2, RETRY_MOST)
