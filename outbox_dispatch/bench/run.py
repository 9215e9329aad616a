"""``scripts/bench``: per-row outbox throughput against plain Celery ``delay()``.

Both runs use the same broker, the same worker command (prefork, same concurrency, prefetch 1)
and handlers that do the same work (one Redis INCR). Figures are ratios from one run because
this machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg
import redis

from outbox_dispatch.bench.claimcost import DUE, REPEAT, claim_cost
from outbox_dispatch.cli import table
from outbox_dispatch.validation import Message

APP = "outbox_dispatch.bench.app"


@dataclass
class Figure:
    scenario: str
    rows: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.rows / self.seconds


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", APP, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait_count(r: redis.Redis, key: str, target: int, label: str, timeout: float) -> float:
    """Poll the done-counter until ``target``, printing progress; returns when it got there."""
    t0 = time.monotonic()
    last = 0.0
    while True:
        done = int(r.get(key) or 0)
        now = time.monotonic()
        if done >= target:
            return now
        if now - last >= 1.0:
            last = now
            print(f"  {label}: {done}/{target} ({now - t0:.1f}s)", flush=True)
        if now - t0 > timeout:
            raise RuntimeError(f"{label}: only {done}/{target} done after {timeout:.0f} s")
        time.sleep(0.01)


def _scenario(
    name: str,
    rows: int,
    procs_args: list[list[str]],
    produce: Callable[[int], None],
    r: redis.Redis,
    key: str,
    logdir: Path,
) -> Figure:
    slug = "".join(ch if ch.isalnum() else "-" for ch in name)
    procs = [_spawn(a, logdir / f"{slug}-{i}.log") for i, a in enumerate(procs_args)]
    try:
        r.set(key, 0)
        produce(1)  # warm-up: the worker is up and connected when this one is done
        _wait_count(r, key, 1, f"{name} warm-up", 60)
        r.set(key, 0)
        t0 = time.monotonic()
        produce(rows)
        t1 = _wait_count(r, key, rows, name, 600)
        return Figure(name, rows, t1 - t0)
    finally:
        _stop(procs)


PACES = (50, 200)  # rows per second offered in the latency scenarios
PACE_SECONDS = 10


@dataclass
class Latency:
    scenario: str
    rows: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def _paced(send: Callable[[float], None], pace: int) -> int:
    """Send ``pace`` rows per second for PACE_SECONDS, each stamped with its send time."""
    n = pace * PACE_SECONDS
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / pace - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        send(time.time())
    return n


def _latency(
    name: str,
    procs_args: list[list[str]],
    produce: Callable[[int], int],
    pace: int,
    r: redis.Redis,
    logdir: Path,
) -> Latency:
    from outbox_dispatch.bench import app as bench

    slug = "".join(ch if ch.isalnum() else "-" for ch in name)
    procs = [_spawn(a, logdir / f"latency-{slug}-{i}.log") for i, a in enumerate(procs_args)]
    try:
        time.sleep(4)  # boot: the worker and its listener are up before the clock starts
        r.delete(bench.LATENCIES)
        r.set(bench.COUNTER, 0)
        print(f"  {name}: offering {pace} rows/s for {PACE_SECONDS} s", flush=True)
        n = produce(pace)
        _wait_count(r, bench.COUNTER, n, name, 120)
        values = sorted(float(v) * 1000 for v in r.lrange(bench.LATENCIES, 0, -1))

        def pick(q: float) -> float:
            return round(values[min(len(values) - 1, int(q * len(values)))], 1)

        return Latency(
            f"{name} @ {pace}/s", len(values), pick(0.50), pick(0.99), round(values[-1], 1)
        )
    finally:
        _stop(procs)


def run_bench(
    rows: int = 5000, concurrency: int = 2, out: str = "bench-results", pool: str = "prefork"
) -> int:
    from outbox_dispatch.bench import app as bench

    r = redis.Redis.from_url(bench.REDIS_URL)
    r.flushdb()  # the benchmark owns its Redis db
    with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{bench.SCHEMA}" CASCADE')
    bench.dispatcher.migrate()
    logdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    worker = ["worker", "-P", pool, "-c", str(concurrency), "--loglevel", "WARNING"]
    print(
        f"bench: {rows} no-op deliveries per scenario, worker -P {pool} -c {concurrency}; "
        f"logs in {logdir}"
    )

    def plain(n: int) -> None:
        with bench.app.producer_or_acquire() as producer:
            for i in range(n):
                bench.noop.apply_async((i,), producer=producer)

    def outbox(command: str, actors: int = 0) -> Callable[[int], None]:
        def produce(n: int) -> None:
            with psycopg.connect(bench.DATABASE_URL) as conn:
                for start in range(0, n, 1000):
                    batch = range(start, min(n, start + 1000))
                    msgs = [
                        Message(command, {"i": i}, actor=f"a{i % actors}" if actors else None)
                        for i in batch
                    ]
                    with conn.transaction():
                        bench.dispatcher.enqueue_many(conn, msgs)

        return produce

    def plain_paced(pace: int) -> int:
        with bench.app.producer_or_acquire() as producer:
            return _paced(
                lambda sent: bench.plain_latency.apply_async((sent,), producer=producer), pace
            )

    def outbox_paced(pace: int) -> int:
        with psycopg.connect(bench.DATABASE_URL) as conn:

            def one(sent: float) -> None:
                with conn.transaction():  # one business transaction per row
                    bench.dispatcher.enqueue(conn, "bench.latency", {"sent": sent})

            return _paced(one, pace)

    beat = ["beat", "--loglevel", "WARNING", "-s", str(logdir / "beat-schedule")]
    both = [worker, beat]
    scenarios: list[tuple[str, list[list[str]], Callable[[int], None]]] = [
        ("celery delay()", [worker], plain),
        ("outbox per-row", both, outbox("bench.noop")),
        ("100 actors, uncapped", both, outbox("bench.uncapped", 100)),
        ("100 actors, cap 4", both, outbox("bench.capped", 100)),
        ("outbox batched (50/msg)", both, outbox("bench.batched")),
    ]
    figures = [
        _scenario(name, rows, procs, produce, r, bench.COUNTER, logdir)
        for name, procs, produce in scenarios
    ]
    latency = [
        _latency(name, procs, produce, pace, r, logdir)
        for pace in PACES
        for name, procs, produce in (
            ("celery delay()", [worker], plain_paced),
            ("outbox (commit wake)", both, outbox_paced),
        )
    ]
    bench.dispatcher.close()
    print("claim cost:")
    costs = claim_cost(bench.DATABASE_URL, bench.SCHEMA + "_claims")
    base = figures[0].per_second
    shown = [
        {
            "scenario": f.scenario,
            "rows": f.rows,
            "seconds": f"{f.seconds:.2f}",
            "rows/s": f"{f.per_second:.0f}",
            "ratio": f"{f.per_second / base:.2f}x",
        }
        for f in figures
    ]
    print()
    print(table(shown, ["scenario", "rows", "seconds", "rows/s", "ratio"]))
    print()
    print(f"commit (or publish) -> handler start, each rate offered for {PACE_SECONDS} s:")
    print(table([asdict(x) for x in latency], ["scenario", "rows", "p50_ms", "p99_ms", "max_ms"]))
    print()
    print(f"claim of {DUE} due rows (median of {REPEAT}):")
    print(table([asdict(c) for c in costs], ["stored_not_due", "median_ms"]))
    print(f"ratio with / without: {costs[1].median_ms / costs[0].median_ms:.2f}x")
    Path(out).mkdir(parents=True, exist_ok=True)
    result = {
        "figures": [asdict(f) | {"per_second": f.per_second} for f in figures],
        "latency": [asdict(x) for x in latency],
        "claim_cost": [asdict(c) for c in costs],
    }
    (Path(out) / "bench.json").write_text(json.dumps(result, indent=2))
    print(
        f"\nbench: outbox per-row / plain Celery = {figures[1].per_second / base:.2f}x; "
        f"capped / uncapped = {figures[3].per_second / figures[2].per_second:.2f}x; "
        f"batched / plain Celery = {figures[4].per_second / base:.2f}x "
        f"(written to {out}/bench.json)"
    )
    return 0
