"""What every benchmarked system shares: its processes, a producer, the done-counter in Redis,
progress lines, and the timed and paced runs.

Every system's handler does the same work (one Redis INCR of ``COUNTER``; the latency handler
also pushes its delay), so the driver times them all the same way: from the first enqueue (or
publish) to the moment the counter reaches the row count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench import cpu
from bench.report import Latency, Throughput, percentile

APP = "bench.app"
COUNTER = "outbox-bench:done"
LATENCIES = "outbox-bench:latency"
# keys the benchmark owns in its Redis db, deleted by pattern: the db may be shared, never flushed
# (django-celery-outbox's relay declares kombu's delayed-delivery bindings: _kombu.binding_*)
OWN_KEYS = ("outbox-bench:*", "outbox:*", "outbox.*", "celery", "_kombu.binding*", "unacked*")


T0 = time.monotonic()


def say(message: str) -> None:
    """Progress goes to stderr, so ``--json`` output on stdout stays clean; each line says
    how long the run has taken so far."""
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def clean_redis(r: redis.Redis) -> int:
    deleted = 0
    for pattern in OWN_KEYS:
        keys = list(r.scan_iter(match=pattern, count=1000))
        for start in range(0, len(keys), 500):
            deleted += int(r.delete(*keys[start : start + 500]))
    return deleted


def vacuum(database_url: str) -> None:
    """VACUUM ANALYZE the benchmark's database before a scenario, as autovacuum would between
    them on a production server (this machine's Postgres runs without it): the dead rows of
    the scenarios before would otherwise slow every index scan of the next one."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


@dataclass
class Proc:
    """One long-running process of a system (worker, beat, relay)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""


def celery(*args: str, env: dict[str, str] | None = None) -> Proc:
    """``celery -A bench.app ...``: the same app for every Celery-based system."""
    return Proc([sys.executable, "-m", "celery", "-A", APP, *args], env or {}, args[0])


def python_module(module: str, *args: str, name: str = "") -> Proc:
    return Proc([sys.executable, "-m", module, *args], {}, name or module)


@dataclass
class System:
    """A benchmarked system: its processes, and producers that write rows in transactions."""

    scenario: str
    system: str
    procs: list[Proc]
    produce: Callable[[int], None]  # ``n`` no-op rows
    paced: Callable[[int, float], int] | None = None  # (rows/s, seconds) -> rows, time-stamped
    note: str = ""


def slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def spawn(proc: Proc, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        proc.argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **proc.env},
    )


def start(procs: list[Proc], logdir: Path, label: str) -> list[subprocess.Popen[bytes]]:
    return [
        spawn(p, logdir / f"{slug(label)}-{i}-{slug(p.name) or 'proc'}.log")
        for i, p in enumerate(procs)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process group (warm shutdown), SIGKILL after 20 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def check_alive(procs: list[subprocess.Popen[bytes]], label: str) -> None:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"{label}: a process exited with {p.returncode}: {p.args!r}")


class Progress:
    """One progress line per interval; on a terminal it rewrites itself in place."""

    def __init__(self, label: str, target: int, t0: float | None = None) -> None:
        self.label = label
        self.target = target
        self.tty = sys.stderr.isatty()
        self.interval = 0.5 if self.tty else 2.0
        self.t0 = time.monotonic() if t0 is None else t0  # when the timed work began
        self.last = 0.0

    def tick(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        pct = 100.0 * done / self.target if self.target else 100.0
        line = (
            f"  {self.label}: {done:,}/{self.target:,} ({pct:.0f} %, {elapsed:.1f} s, "
            f"{rate:,.0f}/s)"
        )
        if self.tty:
            stamp = f"[{now - T0:6.1f}s] "
            print("\r" + stamp + line.ljust(100), end="", file=sys.stderr, flush=True)
        else:
            say(line)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def wait_count(
    r: redis.Redis,
    target: int,
    label: str,
    timeout: float,
    procs: list[subprocess.Popen[bytes]] | None = None,
    on_poll: Callable[[int], None] | None = None,
    stall: float = 120.0,
    t0: float | None = None,
) -> float:
    """Poll the done-counter until ``target`` with progress; returns the monotonic time then.
    Gives up after ``timeout`` seconds, or ``stall`` seconds without one more delivery.
    ``t0``: when the timed work began (progress rates count from there)."""
    progress = Progress(label, target, t0)
    started = last_change = time.monotonic()
    last_done = -1
    try:
        while True:
            done = int(r.get(COUNTER) or 0)
            now = time.monotonic()
            if on_poll is not None:
                on_poll(done)
            if done >= target:
                progress.tick(done, force=True)
                return now
            progress.tick(done)
            if done != last_done:
                last_done, last_change = done, now
            if now - last_change > stall:
                raise RuntimeError(f"{label}: stuck at {done}/{target} for {stall:.0f} s")
            if now - started > timeout:
                raise RuntimeError(f"{label}: only {done}/{target} done after {timeout:.0f} s")
            if procs:
                check_alive(procs, label)
            time.sleep(0.01)
    finally:
        progress.done()


def warm_up(system: System, r: redis.Redis, procs: list[subprocess.Popen[bytes]]) -> None:
    """One row through the whole path: every process is up and connected before the clock."""
    r.set(COUNTER, 0)
    system.produce(1)
    wait_count(r, 1, f"{system.scenario} warm-up", 90, procs)
    r.set(COUNTER, 0)


def pace_loop(send: Callable[[float], None], pace: int, seconds: float) -> int:
    """Call ``send(wall time)`` ``pace`` times a second for ``seconds``, on schedule."""
    n = max(1, int(pace * seconds))
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / pace - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        send(time.time())
    return n


def measure(
    system: System,
    r: redis.Redis,
    logdir: Path,
    *,
    rows: int = 0,
    paces: Sequence[int] = (),
    seconds: float = 10.0,
) -> tuple[Throughput | None, list[Latency]]:
    """Start the system once and warm it up; then time ``rows`` rows from the first enqueue
    to the last run, and offer each of ``paces`` rows/s for ``seconds``, every handler noting
    its commit-to-start delay."""
    procs = start(system.procs, logdir, system.scenario)
    figure = None
    latencies: list[Latency] = []
    try:
        warm_up(system, r, procs)
        if rows:
            say(f"throughput: {system.scenario}, {rows:,} rows")
            before = cpu.sample(p.pid for p in procs)
            t0 = time.monotonic()
            system.produce(rows)
            produced = time.monotonic() - t0
            t1 = wait_count(r, rows, system.scenario, 900, procs, t0=t0)
            used = cpu.per_row_ms(before, cpu.sample(p.pid for p in procs), rows)
            figure = Throughput(system.scenario, system.system, rows, t1 - t0, produced, used)
            say(
                f"  -> {figure.per_second:,.0f} rows/s ({figure.seconds:.2f} s), "
                f"CPU {used['total']:.2f} ms/row"
            )
        for pace in paces if system.paced is not None else ():
            assert system.paced is not None
            time.sleep(1.0)  # the worker's listener (if any) is subscribed; the last burst is over
            r.delete(LATENCIES)
            r.set(COUNTER, 0)
            say(f"latency: {system.scenario}, offering {pace} rows/s for {seconds:g} s")
            t0 = time.monotonic()
            n = system.paced(pace, seconds)
            wait_count(r, n, f"{system.scenario} @ {pace}/s", 300, procs, t0=t0)
            values = sorted(float(v) * 1000 for v in r.lrange(LATENCIES, 0, -1))
            lat = Latency(
                system.scenario,
                system.system,
                pace,
                len(values),
                round(percentile(values, 0.50), 1),
                round(percentile(values, 0.99), 1),
                round(values[-1] if values else 0.0, 1),
            )
            latencies.append(lat)
            say(f"  -> p50 {lat.p50_ms} ms, p99 {lat.p99_ms} ms")
        return figure, latencies
    finally:
        stop(procs)
