"""Prometheus metrics.

Counters and histograms are recorded where the work happens (claims in the claimer, outcomes
and timings in delivery), in whichever process does it. Prefork workers run many processes, so
they record in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) and one
server adds the files up. Gauges describe the outbox itself, not a process: they are read from
Postgres and the broker when scraped, so any number of servers report the same figures.

prometheus_client picks its storage when it is first imported, so it is imported here lazily:
``outbox-dispatch worker --metrics-port`` sets the directory before anything records.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox_dispatch.core.logs import event

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Latency buckets from the NOTIFY path (milliseconds) to the beat safety net (seconds) and
# beyond (backoff, caps, overload).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0)


@dataclass(frozen=True)
class _Instruments:
    claimed: Any
    outcomes: Any
    claim_seconds: Any
    start_latency: Any
    handler_seconds: Any


@functools.cache
def _instruments() -> _Instruments:
    from prometheus_client import Counter, Histogram

    return _Instruments(
        claimed=Counter(
            "outbox_claimed", "Rows claimed and published to the broker", ["database", "family"]
        ),
        outcomes=Counter(
            "outbox_deliveries",
            "Delivery outcomes: delivered, retried, parked, cancelled, stale (message dropped: "
            "its claim no longer held), lost (settle refused: the lease ran out)",
            ["database", "family", "outcome"],
        ),
        claim_seconds=Histogram(
            "outbox_claim_duration_seconds",
            "One family's claim: lock, count in flight, lease rows, commit",
            ["database", "family"],
            buckets=DURATION_BUCKETS,
        ),
        start_latency=Histogram(
            "outbox_commit_to_start_seconds",
            "From the moment a row was due (for a row due at enqueue: its transaction) to the "
            "start of its handler",
            ["database", "family"],
            buckets=LATENCY_BUCKETS,
        ),
        handler_seconds=Histogram(
            "outbox_handler_duration_seconds",
            "Handler run time (for a one-row message, its settle included)",
            ["database", "family", "command"],
            buckets=DURATION_BUCKETS,
        ),
    )


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """Metrics never fail a claim or a delivery."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            event(log, logging.WARNING, "metrics_failed", f"could not record a metric: {exc!r}")

    return wrapper


@_guarded
def warm() -> None:
    """Import prometheus_client and create the instruments now (a pool process as it starts,
    its storage already chosen), so that the first delivery does not pay for the import."""
    _instruments()


# Every series carries the database it is about: ``default`` for a dispatcher of one database,
# ``unknown`` for a message that named none of the dispatcher's databases (a forged name must
# not become a label of its own).


@_guarded
def claimed(family: str, rows: int, seconds: float, database: str = "default") -> None:
    m = _instruments()
    m.claim_seconds.labels(database, family).observe(seconds)
    if rows:
        m.claimed.labels(database, family).inc(rows)


@_guarded
def outcome(family: str | None, outcome: str, database: str = "default") -> None:
    _instruments().outcomes.labels(database, family or "unknown", outcome).inc()


@_guarded
def started(family: str, waited: float | None, database: str = "default") -> None:
    if waited is not None and waited >= 0:
        _instruments().start_latency.labels(database, family).observe(waited)


@_guarded
def handled(family: str, command: str, seconds: float, database: str = "default") -> None:
    _instruments().handler_seconds.labels(database, family, command).observe(seconds)


# -- the scrape side ---------------------------------------------------------------------------

STATUS_CACHE = 10.0  # seconds one status read serves scrapes for

GAUGES = {
    # name suffix: (help, FamilyStatus field)
    "due": ("Rows due now and not claimed", "due"),
    "scheduled": ("Rows due later (delay, at, backoff)", "scheduled"),
    "in_flight": ("Rows claimed, in the broker or running", "in_flight"),
    "waiting": ("Capped rows waiting for their actor's slot", "waiting"),
    "blocked": ("Ordered rows waiting behind their actor's head", "blocked"),
    "parked": ("Parked rows (dead letters): see `outbox-dispatch parked list`", "parked"),
    "maybe_applied": (
        "Unsettled rows whose earlier attempt ended without an outcome",
        "maybe_applied",
    ),
    "oldest_due_age_seconds": ("Age of the oldest row due and not claimed", "oldest_due_age"),
    "paused": ("1 while the family is paused (`outbox-dispatch resume FAMILY`)", "paused"),
}


class OutboxCollector:
    """Per-family gauges read at scrape time from Postgres (the status query) and the broker
    (queue lengths, which Flower does not show)."""

    def __init__(self, dispatcher: Dispatcher, cache_seconds: float = STATUS_CACHE) -> None:
        self.dispatcher = dispatcher
        self.cache_seconds = cache_seconds
        self._cached: tuple[float, list[Any]] | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: registering must not touch Postgres

    def collect(self) -> Iterator[Any]:
        """The gauges, from a status read at most once per ``cache_seconds`` (a scrape
        interval): several scrapers, or a fast one, cost Postgres one status query."""
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_seconds:
                self._cached = (now, list(self._read()))
            metrics = self._cached[1]
        yield from metrics

    def _read(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily(
            "outbox_up",
            "1 when the database answered this scrape's status query",
            labels=["database"],
        )
        statuses = []
        for name in self.dispatcher.databases:  # one database down hides only its own rows
            try:
                statuses += self.dispatcher.ops.status(name)
            except Exception as exc:
                event(
                    log,
                    logging.WARNING,
                    "metrics_status_failed",
                    f"status query failed: {exc}",
                    database=name,
                )
                up.add_metric([name], 0)
            else:
                up.add_metric([name], 1)
        yield up
        for suffix, (text, attr) in GAUGES.items():
            g = GaugeMetricFamily(f"outbox_{suffix}", text, labels=["database", "family"])
            for s in statuses:
                g.add_metric([s.database, s.family], float(getattr(s, attr)))
            yield g
        q = GaugeMetricFamily(
            "outbox_queue_length",
            "Messages waiting in the family's broker queue",
            labels=["family"],
        )
        for family, n in self.dispatcher.runtime.queue_lengths().items():
            q.add_metric([family], float(n))
        yield q


def registry(dispatcher: Dispatcher | None, cache_seconds: float = STATUS_CACHE) -> Any:
    """A registry with the outbox gauges, and the counters and histograms of this process, or
    of every process that wrote to the multiprocess directory."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get(MULTIPROC_ENV):
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)  # type: ignore[no-untyped-call]
    else:
        reg = CollectorRegistry()
        _instruments()  # registers the counters in the default registry
        reg.register(_Forward(REGISTRY))
    if dispatcher is not None:
        reg.register(OutboxCollector(dispatcher, cache_seconds))
    return reg


class _Forward:
    """Exposes another registry's metrics (this process's counters) inside ours."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        yield from self.source.collect()


def serve(
    dispatcher: Dispatcher | None,
    port: int,
    addr: str | None = None,
    cache_seconds: float = STATUS_CACHE,
) -> Any:
    """Serve /metrics on a daemon thread; returns the server (``shutdown()`` then
    ``server_close()`` stop it)."""
    from prometheus_client import start_http_server

    addr = addr or os.environ.get(ADDR_ENV) or "127.0.0.1"
    reg = registry(dispatcher, cache_seconds)
    server, _thread = start_http_server(port, addr=addr, registry=reg)
    event(
        log, logging.INFO, "metrics_serving", f"Prometheus metrics on http://{addr}:{port}/metrics"
    )
    return server


def prepare_multiprocess_dir(path: str | None = None) -> Path:
    """Point this process and its children at an empty multiprocess directory (stale files of a
    previous run would add old counts to the new one)."""
    chosen = Path(path or os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="outbox-prom-"))
    chosen.mkdir(parents=True, exist_ok=True)
    for stale in chosen.glob("*.db"):  # prometheus_client's files only, nothing else in it
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(chosen)
    return chosen


PORT_ENV = "OUTBOX_METRICS_PORT"
# where /metrics listens: loopback unless told (the page has no auth: expose it on purpose)
ADDR_ENV = "OUTBOX_METRICS_ADDR"


def install_worker_server(app: Any, dispatcher: Dispatcher) -> None:
    """With ``OUTBOX_METRICS_PORT`` set, a worker's main process serves /metrics for the whole
    worker: its pool children record into the multiprocess directory set up before they fork."""
    from celery import bootsteps

    class OutboxMetrics(bootsteps.StartStopStep):  # type: ignore[misc]
        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.server: Any = None
            self.port = int(os.environ[PORT_ENV]) if os.environ.get(PORT_ENV) else None
            if self.port is not None and not os.environ.get(MULTIPROC_ENV):
                prepare_multiprocess_dir()
            if self.port is not None:
                _check_multiprocess_storage()

        def start(self, parent: Any) -> None:
            if self.port is None:
                return
            try:
                self.server = serve(dispatcher, self.port)
            except OSError as exc:  # metrics never stop a worker: say so and run without
                event(
                    log,
                    logging.ERROR,
                    "metrics_not_serving",
                    f"cannot serve metrics on port {self.port}: {exc}; is another worker on "
                    "this host using it? give each worker its own OUTBOX_METRICS_PORT",
                )

        def stop(self, parent: Any) -> None:
            if self.server is not None:
                self.server.shutdown()
                self.server.server_close()
                self.server = None

    app.steps["worker"].add(OutboxMetrics)


def _check_multiprocess_storage() -> None:
    import sys

    values = sys.modules.get("prometheus_client.values")
    if values is not None and getattr(values.ValueClass, "__name__", "") == "MutexValue":
        event(
            log,
            logging.WARNING,
            "metrics_not_multiprocess",
            "prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set, so pool "
            "processes keep their counts to themselves: set PROMETHEUS_MULTIPROC_DIR (an empty "
            "directory) in the worker's environment, or start it with "
            "`outbox-dispatch worker --metrics-port N`",
        )
