"""The commit listener, which keeps commit-to-start latency low: enqueue sends a NOTIFY that
Postgres delivers at commit, and the listener of one worker claims at once, so the beat interval
is not the latency (the beat entry stays as the safety net).

One listener per schema across all workers: the first takes a session advisory lock, the
others wait to take over if it dies. The listener claims serially: notifications that arrive
while a claim pass runs (or within ``coalesce`` seconds of the first) are served by one pass,
so a burst of commits is not a burst of claims, and a lone commit waits for nothing. When it
starts listening it claims every family once: commits made while nobody listened (workers
starting, a standby taking over) sent notifications that no one received. Every ``sweep``
seconds (the dispatcher's ``claim_interval``) it claims every family again, for rows that come
due without a commit (delays, retries, lapsed leases): beat's claim entry, which would send a
task to a pool process every second for that, then runs only as the safety net (every
``timings.SAFETY_INTERVAL``), since each of its ticks delays the deliveries around it.

A family whose claim stopped at its in-flight limit (or a full queue), or that was left
because its queue holds work for every consumer (policy.claim_can_wait: its rows are claimed
together, and packed, once it drains), is claimed again every ``refill`` seconds until a
claim finds fewer due rows than it could take: under a backlog the queue is topped up as
workers free room, without waiting for beat and without a claim loop that spins on a few
rows at a time.

A capped family whose claim took freed cap slots is claimed again ``trail`` seconds later
(the caps' wake window). A release wakes the claimer only once per window (caps_release.lua),
so slots freed within the same window after a claim took the first ones announce nothing, and
their actors' waiting rows would sit until the next sweep with every slot free. The trailing
claim takes them; it repeats while claims find freed slots, and one that finds none ends it.
Slots are noted freed only while rows wait for them (caps_acquire.lua), so a capped family at
low load starts no trail.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

import psycopg

from outbox_dispatch.claim.claimer import ClaimReport
from outbox_dispatch.core import timings
from outbox_dispatch.core.logs import about_database, event, mask_dsn
from outbox_dispatch.core.naming import quoted
from outbox_dispatch.store.sqlfiles import raw_queries

log = logging.getLogger(__name__)

RETRY_FIRST = 0.5  # seconds before the listener claims again after a failed pass
RETRY_MOST = 8.0  # ... doubled after each further failure, up to this


class CommitListener:
    def __init__(
        self,
        database_url: str,
        schema: str,
        channel: str,
        claim: Callable[[list[str] | None], ClaimReport],
        *,
        coalesce: float = 0.0,
        standby_retry: float = 1.0,
        refill: float = timings.REFILL,
        sweep: float | None = None,
        database: str | None = None,
        trail: float | None = None,
    ) -> None:
        self.database = database  # its name in log lines, when the dispatcher has several
        self.database_url = database_url
        self.schema = schema
        self.channel = channel
        self.claim = claim
        self.coalesce = coalesce
        self.standby_retry = standby_retry
        self.refill = refill
        self.sweep = sweep
        self.trail = trail  # seconds before a family that took freed slots is claimed again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.leading = threading.Event()
        self._failures = 0  # claim passes failed in a row (not Postgres lost: that retries at 1 s)
        self._lost = False  # Postgres is lost and the listener said so

    def start(self) -> None:
        self._stop.clear()
        name = "outbox-listener" + (f"-{self.database}" if self.database else "")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        with about_database(self.database):
            self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve()
            except psycopg.Error as exc:
                self.leading.clear()
                first, self._lost = not self._lost, True
                event(
                    log,
                    logging.WARNING if first else logging.DEBUG,  # once an outage
                    "commit_listener_down",
                    f"listener lost Postgres at {mask_dsn(self.database_url)} "
                    f"({mask_dsn(str(exc))}); "
                    "beat's claim entry keeps rows moving, retrying in 1 s",
                )
                self._stop.wait(1.0)
            except Exception as exc:  # a claim failed: log it, keep listening
                # a broker that stays away fails every pass, each claiming and giving back a
                # batch of rows: the passes back off, from 0.5 s to RETRY_MOST
                self._failures += 1
                wait = min(RETRY_FIRST * 2 ** (self._failures - 1), RETRY_MOST)
                event(
                    log,
                    logging.ERROR,
                    "listener_claim_failed",
                    f"{exc!r}; claiming again in {wait:g} s",
                )
                self._stop.wait(wait)

    def _serve(self) -> None:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            # its waits are idle: a server's idle_session_timeout must not end them
            # (sql/session.sql)
            q = raw_queries()
            conn.execute(q["session_defaults"])
            if self._lost:
                self._lost = False
                event(log, logging.INFO, "commit_listener_back", "listening again")
            lock = f"{self.schema}.wake-listener"  # the same in every version: one listener leads
            while not self._stop.is_set():
                row = conn.execute(
                    "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (lock,)
                ).fetchone()
                if row and row[0]:
                    break
                self._stop.wait(self.standby_retry)  # another worker listens; stand by
            if self._stop.is_set():
                return
            conn.execute(f"LISTEN {quoted(self.channel)}")
            self.leading.set()
            event(log, logging.INFO, "listener_listening", f"listening on {self.channel}")
            # commits made while no listener listened (workers starting, a listener taking
            # over) sent notifications nobody received: one pass claims them now, not at beat's
            trailing: dict[str, float] = {}  # family -> when to claim it for freed slots
            report = self.claim(None)
            self._failures = 0
            saturated = _held_back(report)
            self._trail(report, trailing)
            next_sweep = self._next_sweep()
            while not self._stop.is_set():
                wait = self.refill if saturated else 0.5
                if next_sweep is not None:
                    wait = min(wait, next_sweep - time.monotonic())
                if trailing:
                    wait = min(wait, min(trailing.values()) - time.monotonic())
                payloads = [n.payload for n in conn.notifies(timeout=max(0.0, wait), stop_after=1)]
                if next_sweep is not None and time.monotonic() >= next_sweep:
                    # rows that came due without a commit (delays, retries, lapsed leases);
                    # the families just notified are among every family
                    report = self.claim(None)
                    saturated = _held_back(report)
                    self._trail(report, trailing)
                    next_sweep = self._next_sweep()
                    continue
                now = time.monotonic()
                trailed = {f for f, at in trailing.items() if at <= now}
                if not payloads and not saturated and not trailed:
                    continue
                if payloads:
                    payloads += [n.payload for n in conn.notifies(timeout=self.coalesce)]
                families = {family_of(p) for p in payloads} | trailed
                for family in trailed:
                    del trailing[family]
                report = self.claim(sorted(families | saturated))
                saturated = _held_back(report)
                self._trail(report, trailing)

    def _trail(self, report: ClaimReport, trailing: dict[str, float]) -> None:
        """Claim the families that took freed slots again one wake window from now (the
        latest such claim counts: the releases it could not see came after it)."""
        if self.trail is None:
            return
        at = time.monotonic() + self.trail
        for family in getattr(report, "freed", None) or ():
            trailing[family] = at

    def _next_sweep(self) -> float | None:
        return None if self.sweep is None else time.monotonic() + self.sweep


def family_of(payload: str) -> str:
    """The family a NOTIFY wakes: the payload is its name, or a JSON array whose first item
    is the family (a row-naming payload, read so that a rolling deploy leaves no commit
    unclaimed)."""
    if payload.startswith("["):
        try:
            first = json.loads(payload)[0]
        except (ValueError, TypeError, IndexError, KeyError):
            return payload
        return first if isinstance(first, str) else payload
    return payload


def _held_back(report: ClaimReport) -> set[str]:
    """The families a claim pass left at their in-flight limit: claimed again every refill."""
    return set(getattr(report, "saturated", None) or ())


class ListenerProcess:
    """A worker's commit listeners, run in a process of their own.

    A listener claims (a transaction in Postgres) and publishes (a round trip to the broker)
    for every commit it hears of; in a process of its own it shares no interpreter with
    Celery's consumer, which fetches and hands out every delivery message, so under a stream
    of commits neither waits on the other. The child is forked from the worker's main process
    once its pool has started; it stops with the worker, or when it finds its parent gone (a
    worker killed with -9), which ends its Postgres sessions and so passes the listener's lock
    to another worker's listener."""

    def __init__(self, make: Callable[[], list[CommitListener]]) -> None:
        self.make = make
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        self._proc = context.Process(
            target=_serve_listeners,
            args=(self.make, os.getpid()),
            name="outbox-listener",
            daemon=True,
        )
        self._proc.start()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()  # SIGTERM: its listeners stop and close their sessions
            proc.join(LISTENER_STOP)
        if proc.is_alive():
            proc.kill()
            proc.join()


LISTENER_STOP = 10.0  # seconds a worker's shutdown waits for its listener process to stop
PARENT_CHECK = 1.0  # seconds between the listener process's looks for its worker


def _serve_listeners(make: Callable[[], list[CommitListener]], parent: int) -> None:
    """The listener process: run the listeners until told to stop, or the worker is gone."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the worker's to act on
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    listeners = make()
    for listener in listeners:
        listener.start()
    try:
        while not stop.wait(PARENT_CHECK):
            if os.getppid() != parent:
                event(
                    log,
                    logging.WARNING,
                    "listener_orphaned",
                    "the worker that started this listener process is gone: it stops, and "
                    "another worker's listener takes over",
                )
                break
    finally:
        for listener in listeners:
            listener.stop()
