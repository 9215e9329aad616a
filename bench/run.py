"""``scripts/bench``: the outbox against plain Celery and two peers, in one run.

Every system runs the same no-op work (one Redis INCR per delivery) with the same worker
concurrency, against the same Postgres and Redis, one system at a time:

- **throughput**: plain Celery ``apply_async()``, the outbox (per-row, 100 actors uncapped
  and capped, a batched family), then the peers (procrastinate, django-celery-outbox, see
  peers.py); rows are produced in transactions of 1,000 while the worker runs, timed from the
  first enqueue to the last handler run.
- **latency**: commit (or publish) to handler start at paced offered rates.
- **claimcost**: one claim of 500 due rows, alone and next to many rows that are not due.
- **rss**: the worker's resident memory (VmRSS of its main and pool processes) after
  ``--rss-warmup`` and after ``--rss-rows`` deliveries of ``--rss-family`` (batched by
  default: 100k per-row deliveries take about 6 minutes on this 2-core machine today).
- **backpressure**: ``--bp-rows`` rows due at once, slow handlers, a family with
  ``max_in_flight`` and a short lease: no row may run twice.

Prints absolute figures and ratios (to plain Celery, and ours/theirs for peers), writes
``<out>/bench.json`` and a PNG plot. Figures from one run are comparable with each other;
a shared machine makes the absolute numbers noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis

from bench import procs as P
from bench import rss as rssmod
from bench.claimcost import claim_cost
from bench.report import (
    CAPPED,
    CAPPED_1,
    DEFAULT,
    PER_ROW,
    UNCAPPED,
    UNCAPPED_1,
    Backpressure,
    ClaimCostRow,
    Latency,
    Results,
    RssGrowth,
    RssSample,
    Throughput,
    median_latency,
    median_throughput,
    render,
    results_from_json,
)
from outbox_dispatch.core.validation import Message

SCENARIOS = ("throughput", "peers", "latency", "claimcost", "rss", "backpressure")
PEERS = ("procrastinate", "django-celery-outbox")


@dataclass
class Options:
    rows: int = 5000
    concurrency: int = 2
    pool: str = "prefork"
    out: str = "bench-results"
    plot: str = "docs/bench.png"
    json: bool = False
    scenarios: tuple[str, ...] = SCENARIOS
    peers: tuple[str, ...] = PEERS
    paces: tuple[int, ...] = (50, 200)
    # 1,500 rows a round at 50 rows/s: a p99 of 500 rested on the five slowest, and a round's
    # p99 moved by a millisecond with one stall; the goal compares two p99s 0.4 ms apart
    latency_seconds: float = 30.0
    claim_stored: int = 1_000_000
    rss_rows: int = 100_000
    rss_warmup: int = 10_000
    rss_family: str = "batched"  # per-row: 100k rows take about 6 minutes on 2 shared cores
    bp_rows: int = 30_000
    bp_handler_ms: float = 5.0
    bp_max_in_flight: int = 100
    bp_lease: float = 5.0
    quick: bool = False
    replot: str = ""
    repeat: int = 3  # rounds of the throughput and latency scenarios (this machine is noisy)


QUICK = {
    "rows": 500,
    "paces": (50,),
    "latency_seconds": 2.0,
    "claim_stored": 20_000,
    "rss_rows": 3_000,
    "rss_warmup": 500,
    "bp_rows": 600,
    "repeat": 1,
}


def parse_args(argv: Sequence[str] | None = None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(
        prog="scripts/bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a ~1-minute smoke run (small sizes)")
    p.add_argument(
        "--only",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--skip", default="", help="comma-separated scenarios to leave out")
    p.add_argument("--peers", default=",".join(PEERS), help=f"subset of {','.join(PEERS)}, or ''")
    p.add_argument("--rows", type=int, help=f"rows per throughput scenario ({d.rows})")
    p.add_argument(
        "--repeat",
        type=int,
        help=f"rounds of every throughput and latency scenario, interleaved ({d.repeat}); "
        "the tables show each one's median and the goals the median of the rounds' ratios",
    )
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--pool", default=d.pool, choices=["prefork", "threads"])
    p.add_argument("--paces", help="offered rows/s for latency, comma-separated (50,200)")
    p.add_argument("--latency-seconds", type=float, help="seconds each rate is offered (30)")
    p.add_argument("--claim-stored", type=int, help="rows that are not due (1,000,000)")
    p.add_argument("--rss-rows", type=int, help=f"deliveries for RSS growth ({d.rss_rows:,})")
    p.add_argument("--rss-warmup", type=int, help="deliveries before the first RSS sample")
    p.add_argument("--rss-family", choices=["per-row", "batched"], default=d.rss_family)
    p.add_argument("--bp-rows", type=int, help=f"backpressure rows ({d.bp_rows:,})")
    p.add_argument("--bp-handler-ms", type=float, default=d.bp_handler_ms)
    p.add_argument("--bp-max-in-flight", type=int, default=d.bp_max_in_flight)
    p.add_argument("--bp-lease", type=float, default=d.bp_lease, help="seconds (>= 1)")
    p.add_argument("--out", default=d.out, help="directory for bench.json")
    p.add_argument(
        "--plot", help=f"PNG path ('' for none; default {d.plot}, with --quick under --out)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument(
        "--replot",
        metavar="JSON",
        help="run nothing: redraw --plot and the tables from a bench.json",
    )
    a = p.parse_args(argv)

    chosen = [s for s in a.only.split(",") if s]
    skipped = [s for s in a.skip.split(",") if s]
    peers = [s for s in a.peers.split(",") if s]
    for name in [*chosen, *skipped]:
        if name not in SCENARIOS:
            p.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    for name in peers:
        if name not in PEERS:
            p.error(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    o = Options(**(QUICK if a.quick else {}))  # type: ignore[arg-type]
    o.quick = a.quick
    o.replot = a.replot or ""
    o.concurrency, o.pool, o.out, o.json = a.concurrency, a.pool, a.out, a.json
    # a smoke run never overwrites the README's plot
    o.plot = a.plot if a.plot is not None else (f"{a.out}/bench.png" if a.quick else d.plot)
    o.scenarios = tuple(s for s in SCENARIOS if s in chosen and s not in skipped)
    o.peers = tuple(x for x in PEERS if x in peers)
    o.rss_family = a.rss_family
    o.bp_handler_ms, o.bp_max_in_flight, o.bp_lease = (
        a.bp_handler_ms,
        a.bp_max_in_flight,
        a.bp_lease,
    )
    names = ("rows", "latency_seconds", "claim_stored", "rss_rows", "rss_warmup", "bp_rows")
    for name in (*names, "repeat"):
        if getattr(a, name) is not None:
            setattr(o, name, getattr(a, name))
    if a.paces:
        o.paces = tuple(int(x) for x in a.paces.split(",") if x)
    if a.rss_rows is not None and a.rss_warmup is None:
        o.rss_warmup = max(1, o.rss_rows // 10)
    if o.rss_warmup >= o.rss_rows:
        p.error("--rss-warmup must be below --rss-rows")
    if o.repeat < 1:
        p.error("--repeat must be at least 1")
    return o


# -- the machine --------------------------------------------------------------------------------


def describe_machine(r: redis.Redis, database_url: str) -> dict[str, str]:
    """What a reader needs to judge the absolute figures."""
    cpu = ""
    mem = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    pg = str(row[0]) if row else "?"
    info: dict[str, Any] = r.info("server")
    versions = _versions()
    load = os.getloadavg()
    out = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{os.cpu_count()} x {cpu or platform.processor() or '?'}",
        "memory": mem or "?",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "postgres": f"{pg} (127.0.0.1, same machine)",
        "redis": f"{info.get('redis_version', '?')} (127.0.0.1, same machine)",
        "load at start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    }
    out["packages"] = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("celery", "kombu", "psycopg", "procrastinate", "django-celery-outbox", "Django"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = ""
    return out


# -- our systems ---------------------------------------------------------------------------------


def outbox_systems(o: Options, logdir: Path) -> tuple[list[P.System], P.Proc, P.Proc]:
    from bench import app as bench

    worker = P.celery("worker", "-P", o.pool, "-c", str(o.concurrency), "--loglevel", "WARNING")
    beat = P.celery("beat", "--loglevel", "WARNING", "-s", str(logdir / "beat-schedule"))

    def plain(n: int) -> None:
        with bench.app.producer_or_acquire() as producer:
            for i in range(n):
                bench.noop.apply_async((i,), producer=producer)

    def plain_paced(pace: int, seconds: float) -> int:
        with bench.app.producer_or_acquire() as producer:
            return P.pace_loop(
                lambda sent: bench.plain_latency.apply_async((sent,), producer=producer),
                pace,
                seconds,
            )

    def outbox_paced(pace: int, seconds: float) -> int:
        with psycopg.connect(bench.DATABASE_URL) as conn:

            def one(sent: float) -> None:
                with conn.transaction():  # one business transaction per row
                    bench.dispatcher.enqueue(conn, "bench.latency", {"sent": sent})

            return P.pace_loop(one, pace, seconds)

    both = [worker, beat]
    systems = [
        P.System("celery delay()", "celery", [worker], plain, plain_paced, "no outbox"),
        # due at once: one transaction of every row, then the claims find the backlog
        P.System(
            DEFAULT, "outbox", both, outbox_producer("bench.default", tx_rows=o.rows), outbox_paced
        ),
        P.System(PER_ROW, "outbox", both, outbox_producer("bench.single", tx_rows=o.rows)),
        P.System(UNCAPPED, "outbox", both, outbox_producer("bench.uncapped", 100, o.rows)),
        P.System(CAPPED, "outbox", both, outbox_producer("bench.capped", 100, o.rows)),
        P.System(UNCAPPED_1, "outbox", both, outbox_producer("bench.uncapped1", 100, o.rows)),
        P.System(CAPPED_1, "outbox", both, outbox_producer("bench.capped1", 100, o.rows)),
    ]
    return systems, worker, beat


def outbox_producer(command: str, actors: int = 0, tx_rows: int = 1000) -> Callable[[int], None]:
    """``n`` rows through ``enqueue_many``, ``tx_rows`` per transaction."""
    from bench import app as bench

    def produce(n: int) -> None:
        with psycopg.connect(bench.DATABASE_URL) as conn:
            for start in range(0, n, tx_rows):
                msgs = [
                    Message(command, {"i": i}, actor=f"a{i % actors}" if actors else None)
                    for i in range(start, min(n, start + tx_rows))
                ]
                with conn.transaction():
                    bench.dispatcher.enqueue_many(conn, msgs)

    return produce


# -- RSS growth ---------------------------------------------------------------------------------


def rss_growth(o: Options, worker: P.Proc, beat: P.Proc, r: redis.Redis, logdir: Path) -> RssGrowth:
    """All rows are enqueued first, then one worker delivers them; VmRSS of the worker's
    processes (main and pool children; beat is not the worker) after ``rss_warmup``
    deliveries and after the last."""
    command = "bench.single" if o.rss_family == "per-row" else "bench.batched"
    P.say(f"rss: enqueueing {o.rss_rows:,} rows ({o.rss_family} family)")
    P.clean_redis(r)
    r.set(P.COUNTER, 0)
    outbox_producer(command, tx_rows=5000)(o.rss_rows)
    procs = P.start([worker, beat], logdir, f"rss-{o.rss_family}")
    samples: list[RssSample] = []
    every = max(1, o.rss_rows // 10)
    next_at = [o.rss_warmup]

    def sample(done: int) -> None:
        if done >= next_at[0] and done < o.rss_rows:
            per = rssmod.tree_rss(procs[0].pid)
            samples.append(RssSample(done, sum(per.values()), per))
            P.say(f"  rss at {done:,}: {sum(per.values()) / 1024:.1f} MiB in {len(per)} processes")
            next_at[0] = (done // every + 1) * every

    try:
        t0 = time.monotonic()
        t1 = P.wait_count(r, o.rss_rows, f"rss {o.rss_family}", 1800, procs, sample)
        time.sleep(0.5)  # the last settles finish
        per = rssmod.tree_rss(procs[0].pid)
        end = RssSample(o.rss_rows, sum(per.values()), per)
    finally:
        P.stop(procs)
    warm = samples[0] if samples else end
    return RssGrowth(o.rss_family, o.rss_rows, warm, end, round(t1 - t0, 2), samples)


# -- backpressure -------------------------------------------------------------------------------


def backpressure(
    o: Options, worker: P.Proc, beat: P.Proc, r: redis.Redis, logdir: Path
) -> Backpressure:
    """``bp_rows`` rows due at once (one transaction), ``bp_handler_ms`` handlers, a family
    with ``max_in_flight`` and a short lease. Each handler run is a row in a deliveries table;
    a trigger notes every claim; the driver samples the claimer's in-flight count and the
    queue length. Zero rows may run twice, and no lease may run out while its message waits."""
    from bench import app as bench

    schema = f'"{bench.SCHEMA}"'
    env = {
        "OUTBOX_BENCH_BP_HANDLER_MS": str(o.bp_handler_ms),
        "OUTBOX_BENCH_BP_MAX_IN_FLIGHT": str(o.bp_max_in_flight),
        "OUTBOX_BENCH_BP_LEASE": str(o.bp_lease),
    }
    w = P.Proc(worker.argv, {**worker.env, **env}, worker.name)
    with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {bench.DELIVERIES}")
        conn.execute(
            f"CREATE TABLE {bench.DELIVERIES} (row_id bigint NOT NULL, attempt int NOT NULL,"
            " pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(f"DROP TABLE IF EXISTS {schema}.bench_claims")
        conn.execute(f"CREATE TABLE {schema}.bench_claims (row_id bigint NOT NULL)")
        conn.execute(
            f"CREATE OR REPLACE FUNCTION {schema}.bench_note_claim() RETURNS trigger"
            f" LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {schema}.bench_claims VALUES (NEW.id);"
            " RETURN NULL; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER bench_note_claim AFTER UPDATE OF claim_token ON {schema}.outbox"
            " FOR EACH ROW WHEN (NEW.family = 'bp' AND NEW.claim_token IS NOT NULL"
            " AND NEW.claim_token IS DISTINCT FROM OLD.claim_token)"
            f" EXECUTE FUNCTION {schema}.bench_note_claim()"
        )
    P.clean_redis(r)
    procs = P.start([w, beat], logdir, "backpressure")
    seen = {"in_flight": 0, "queued": 0}
    last = [0.0]
    stop_sampling = threading.Event()

    def sample_loop() -> None:
        """Claimer's in-flight count and queue length, 5 times a second, off the main loop."""
        while not stop_sampling.wait(0.2):
            try:
                fam = next(s for s in bench.dispatcher.ops.status() if s.family == "bp")
                seen["in_flight"] = max(seen["in_flight"], fam.in_flight)
                seen["queued"] = max(seen["queued"], int(r.llen("outbox.bp")))
            except Exception as exc:  # keep sampling; say why once in a while
                if time.monotonic() - last[0] > 5:
                    last[0] = time.monotonic()
                    P.say(f"  backpressure: sampling failed: {exc}")

    sampler = threading.Thread(target=sample_loop, daemon=True)
    try:
        P.warm_up(P.System("backpressure", "outbox", [], outbox_producer("bench.bp")), r, procs)
        with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {bench.DELIVERIES}, {schema}.bench_claims")
        sampler.start()
        P.say(
            f"backpressure: {o.bp_rows:,} rows due at once, {o.bp_handler_ms:g} ms handlers, "
            f"max_in_flight {o.bp_max_in_flight}, lease {o.bp_lease:g} s"
        )
        t0 = time.monotonic()
        outbox_producer("bench.bp", tx_rows=o.bp_rows)(o.bp_rows)
        t1 = P.wait_count(r, o.bp_rows, "backpressure", 1800, procs, t0=t0)
        settled(bench.dispatcher, "bp", r, timeout=o.bp_lease * 3)
    finally:
        stop_sampling.set()
        if sampler.is_alive():
            sampler.join()
        P.stop(procs)
    with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
        d = conn.execute(
            f"SELECT count(*), count(DISTINCT row_id), count(*) FILTER (WHERE attempt > 1)"
            f" FROM {bench.DELIVERIES}"
        ).fetchone()
        twice = conn.execute(
            f"SELECT count(*) FROM (SELECT row_id FROM {bench.DELIVERIES}"
            " GROUP BY row_id HAVING count(*) > 1) t"
        ).fetchone()
        c = conn.execute(
            f"SELECT count(*) - count(DISTINCT row_id) FROM {schema}.bench_claims"
        ).fetchone()
        conn.execute(f"DROP TRIGGER IF EXISTS bench_note_claim ON {schema}.outbox")
        conn.execute(f"DROP FUNCTION IF EXISTS {schema}.bench_note_claim()")
        conn.execute(f"DROP TABLE IF EXISTS {schema}.bench_claims, {bench.DELIVERIES}")
    assert d is not None
    assert twice is not None
    assert c is not None
    return Backpressure(
        rows=o.bp_rows,
        handler_ms=o.bp_handler_ms,
        max_in_flight=o.bp_max_in_flight,
        lease=o.bp_lease,
        seconds=round(t1 - t0, 2),
        delivered_rows=int(d[1]),
        deliveries=int(d[0]),
        twice=int(twice[0]),
        later_attempts=int(d[2]),
        reclaims=int(c[0]),
        max_in_flight_seen=seen["in_flight"],
        max_queue_seen=seen["queued"],
    )


T = TypeVar("T")


def attempt(results: Results, label: str, fn: Callable[[], T]) -> T | None:
    """Run one scenario; a failure is reported and recorded, and the others still run."""
    try:
        return fn()
    except Exception as exc:
        P.say(f"{label}: FAILED: {exc}")
        results.failures.append(f"{label}: {exc}")
        return None


def settled(dispatcher: Any, family: str, r: redis.Redis, timeout: float) -> None:
    """Wait until the family has no unsettled row and no message waiting: after that no
    handler of it can run again, so the deliveries table is final."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fam = next(s for s in dispatcher.status() if s.family == family)
        if fam.due + fam.scheduled + fam.in_flight == 0 and not r.llen(f"outbox.{family}"):
            return
        time.sleep(0.1)
    P.say(f"  {family}: rows still unsettled after {timeout:g} s (counted as they are)")


# -- the run ------------------------------------------------------------------------------------


def peers_available() -> str:
    """'' when the peers can be imported here, else why not."""
    try:
        import django_celery_outbox  # noqa: F401
        import procrastinate  # noqa: F401
    except ImportError as exc:
        return f"{exc} (scripts/bench installs the peers into .venv-bench)"
    return ""


def run(o: Options) -> Results:
    from bench import app as bench
    from bench.plot import plot

    t_start = time.monotonic()
    r = redis.Redis.from_url(bench.REDIS_URL)
    P.clean_redis(r)
    with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{bench.SCHEMA}" CASCADE')
    bench.dispatcher.migrate()
    logdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    results = Results(machine=describe_machine(r, bench.DATABASE_URL))
    results.settings = {
        "scenarios": list(o.scenarios),
        "worker": f"celery worker -P {o.pool} -c {o.concurrency}, prefetch 1",
        "rows": o.rows,
        "paces": list(o.paces),
        "latency_seconds": o.latency_seconds,
        "claim_stored": o.claim_stored,
        "rss": {"rows": o.rss_rows, "warmup": o.rss_warmup, "family": o.rss_family},
        "backpressure": {
            "rows": o.bp_rows,
            "handler_ms": o.bp_handler_ms,
            "max_in_flight": o.bp_max_in_flight,
            "lease": o.bp_lease,
        },
        "quick": o.quick,
        "repeat": o.repeat,
    }
    P.say(f"bench: {', '.join(o.scenarios)}; worker -P {o.pool} -c {o.concurrency}")
    P.say(f"bench: process logs in {logdir}")
    P.say(render(Results(machine=results.machine)).rstrip())
    systems, worker, beat = outbox_systems(o, logdir)
    with ExitStack() as stack:
        peer_systems: list[P.System] = []
        wants_peers = "peers" in o.scenarios and o.peers
        if wants_peers and (why := peers_available()):
            P.say(f"peers: skipped: {why}")
        elif wants_peers:
            from bench.peers import dco_system, procrastinate_system

            for name in o.peers:
                P.say(f"peers: setting up {name} (fresh database on the same Postgres)")
                if name == "procrastinate":
                    peer_systems.append(stack.enter_context(procrastinate_system(o.concurrency)))
                else:
                    peer_systems.append(stack.enter_context(dco_system(o.concurrency, o.pool)))
            results.settings["peers"] = {s.system: s.note for s in peer_systems}

        order = [*(systems if "throughput" in o.scenarios else []), *peer_systems]
        if "latency" in o.scenarios:  # the latency baseline and per-row outbox, even alone
            order += [s for s in systems if s.paced is not None and s not in order]
        # every scenario once per round, the rounds one after another: a scenario and its
        # baseline are minutes apart at most, whatever the machine's other load does meanwhile
        figures: dict[str, list[Throughput | None]] = {s.scenario: [] for s in order}
        rounds: dict[tuple[str, int], list[Latency]] = {}
        for n in range(o.repeat):
            if o.repeat > 1:
                P.say(f"round {n + 1} of {o.repeat}")
            for s in order:
                P.clean_redis(r)
                P.vacuum(bench.DATABASE_URL)
                measured = attempt(
                    results,
                    s.scenario,
                    partial(
                        P.measure,
                        s,
                        r,
                        logdir,
                        rows=o.rows if ("throughput" in o.scenarios or s in peer_systems) else 0,
                        paces=o.paces if "latency" in o.scenarios else (),
                        seconds=o.latency_seconds,
                    ),
                )
                figure, lat = measured if measured is not None else (None, [])
                figures[s.scenario].append(figure)
                for x in lat:
                    rounds.setdefault((x.scenario, x.pace), []).append(x)
        for s in order:
            if (t := median_throughput(figures[s.scenario])) is not None:
                results.throughput.append(t)
        latencies = [m for xs in rounds.values() if (m := median_latency(xs)) is not None]
        rank = {s.scenario: i for i, s in enumerate(order)}
        results.latency = sorted(latencies, key=lambda x: (x.pace, rank[x.scenario]))

    if "rss" in o.scenarios:
        if rssmod.available():
            g = attempt(results, "rss", lambda: rss_growth(o, worker, beat, r, logdir))
            results.rss += [g] if g else []
        else:
            P.say("rss: skipped: no /proc here")
    if "backpressure" in o.scenarios:
        b = attempt(results, "backpressure", lambda: backpressure(o, worker, beat, r, logdir))
        results.backpressure += [b] if b else []
    bench.dispatcher.close()
    if "claimcost" in o.scenarios:
        P.say(f"claim cost: one claim of 500 due rows, alone and next to {o.claim_stored:,} others")
        costs = attempt(
            results,
            "claimcost",
            lambda: claim_cost(bench.DATABASE_URL, bench.SCHEMA + "_claims", o.claim_stored),
        )
        results.claim_cost = [ClaimCostRow(c.stored_not_due, c.median_ms) for c in costs or []]
    P.clean_redis(r)
    with psycopg.connect(bench.DATABASE_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{bench.SCHEMA}" CASCADE')  # leave nothing behind
    results.settings["seconds"] = round(time.monotonic() - t_start, 1)

    Path(o.out).mkdir(parents=True, exist_ok=True)
    (Path(o.out) / "bench.json").write_text(json.dumps(results.to_json(), indent=2) + "\n")
    if o.plot and not plot(results, o.plot):
        o.plot = ""  # nothing drawn: say so at the end
    return results


def _exit_on_term(signum: int, frame: object) -> None:
    """SIGTERM (``timeout``, a CI stop) unwinds like Ctrl-C, so the processes the run started
    are stopped by its ``finally`` blocks instead of being left behind."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    o = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    if o.replot:
        from bench.plot import plot

        results = results_from_json(json.loads(Path(o.replot).read_text()))
        print(json.dumps(results.to_json(), indent=2) if o.json else render(results))
        return 0 if not o.plot or plot(results, o.plot) else 1
    results = run(o)
    text = render(results)
    if o.json:
        P.say(text)
        print(json.dumps(results.to_json(), indent=2))
    else:
        print()
        print(text)
    P.say(
        f"bench: done in {results.settings['seconds']:.0f} s; wrote {o.out}/bench.json"
        + (f" and {o.plot}" if o.plot else "")
    )
    for failure in results.failures:
        P.say(f"bench: FAILED: {failure}")
    return 1 if results.failures else 0


def run_bench(
    rows: int = 5000, concurrency: int = 2, out: str = "bench-results", pool: str = "prefork"
) -> int:
    """What ``outbox-dispatch bench`` calls: the full set with these settings."""
    return main(
        ["--rows", str(rows), "--concurrency", str(concurrency), "--out", out, "--pool", pool]
    )


if __name__ == "__main__":
    sys.exit(main())
