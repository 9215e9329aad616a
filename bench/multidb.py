"""``python -m bench.multidb``: what one Dispatcher serving 1, 2 and 4 databases sustains.

A shop with several databases has an outbox in each (``Dispatcher(databases=...)``); each
database has its own claimer, commit listener and delivery, while the families, the broker
queues and the worker are shared. Two figures per database count, in one run, so the ratios
to one database are comparable on a shared machine:

- **claim**: ``R`` due rows of one family in every database, no worker consuming; rows/s
  that claiming (claim and publish to the Redis broker) sustains over all of them, *serial*
  (one ``claim_and_publish()`` over every database, as beat's claim task runs) and
  *parallel* (one thread per database, each ``claim_and_publish(database=name)``, as a
  worker's commit listeners run).
- **delivery**: a real ``celery worker`` (prefork, concurrency 2) and beat drain ``rows``
  no-op rows (one Redis INCR each) of a family declared with nothing set, spread evenly over
  the databases in transactions of ``tx-rows`` written round-robin; timed from the first
  enqueue to the last handler run.

Each database is a fresh ``od_bench_mdb_<run>_<i>`` on the local server, dropped at the end
(also on failure or SIGTERM); the broker and caps keys carry a prefix of the run and are
deleted at the end. This module is also the Celery app of the worker and beat it starts
(``celery -A bench.multidb``, configured through the environment). Prints two tables and
writes ``<out>/multidb.json``; about 3.5 minutes on 2 shared cores, ``--quick`` about 35 s.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery
from psycopg.conninfo import make_conninfo

from bench import procs as P
from outbox_dispatch import Context, Dispatcher
from outbox_dispatch.core.naming import quoted
from outbox_dispatch.core.tables import table
from outbox_dispatch.core.validation import Message

BASE_URL = os.environ.get(
    "OUTBOX_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/6")
SCHEMA = "outbox_bench"
FAMILY = "mdb"  # the delivery scenario's family: declared with nothing set
CLAIM_FAMILY = "mdbclaim"  # the claim scenario's: no worker settles, so rows stay in flight
# above every backlog this bench makes (checked in parse_args): neither the in-flight count
# (per database) nor the broker room (the shared queue, a quarter of this kept free) stops
# a claim before every row is claimed
CLAIM_IN_FLIGHT = 2_000_000
ENV_DATABASES = "OUTBOX_BENCH_MDB_DATABASES"  # JSON {name: url} for the worker and beat
ENV_PREFIX = "OUTBOX_BENCH_MDB_PREFIX"  # the run's Redis key prefix


# -- the app (driver, worker and beat build the same one) ------------------------------------


def build(databases: dict[str, str], prefix: str, redis_url: str = REDIS_URL) -> Dispatcher:
    """A Celery app and its Dispatcher over ``databases``; every broker key starts with
    ``prefix`` (kombu's global_keyprefix) and so do the caps keys, so the run's keys can be
    deleted without touching anything else in the Redis db."""
    app = Celery("outbox_bench_mdb", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_transport_options={"global_keyprefix": prefix},
    )
    d = Dispatcher(
        app,
        databases=databases,
        redis_url=redis_url,
        schema=SCHEMA,
        key_prefix=prefix.rstrip(":"),
    )
    d.family(FAMILY)
    d.family(CLAIM_FAMILY, max_in_flight=CLAIM_IN_FLIGHT)
    counters = Counters(redis_url, prefix)

    @d.handler("mdb.noop", family=FAMILY)
    def noop(ctx: Context, payload: Any) -> None:
        counters.bump(str(payload["db"]))

    d.declare("mdb.claim", family=CLAIM_FAMILY)  # claimed and published, never delivered
    return d


class Counters:
    """Deliveries counted in Redis, in total and per database (the payload names the
    database the row was written to): the driver times the run by the total and checks that
    every database's rows arrived."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url = redis_url
        self.total = f"{prefix}done"
        self.prefix = prefix
        self._client: redis.Redis | None = None
        self._pid = 0

    def of(self, db: str) -> str:
        return f"{self.prefix}done:{db}"

    def client(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():  # a forked pool child
            self._client, self._pid = redis.Redis.from_url(self.redis_url), os.getpid()
        return self._client

    def bump(self, db: str) -> None:
        pipe = self.client().pipeline(transaction=False)
        pipe.incr(self.total)
        pipe.incr(self.of(db))
        pipe.execute()

    def reset(self, dbs: Sequence[str]) -> None:
        self.client().delete(self.total, *(self.of(db) for db in dbs))

    def read(self, dbs: Sequence[str]) -> tuple[int, dict[str, int]]:
        values = self.client().mget([self.total, *(self.of(db) for db in dbs)])
        total, *each = (int(v or 0) for v in values)
        return total, dict(zip(dbs, each, strict=True))


_worker_dispatcher: Dispatcher | None = None


def __getattr__(name: str) -> Any:
    """``celery -A bench.multidb`` asks for ``app``: built from the environment the driver
    set, only then, so importing the module as the driver builds nothing."""
    global _worker_dispatcher
    if name != "app":
        raise AttributeError(name)
    if _worker_dispatcher is None:
        urls = json.loads(os.environ[ENV_DATABASES])
        _worker_dispatcher = build(urls, os.environ[ENV_PREFIX])
    return _worker_dispatcher.app


# -- options ---------------------------------------------------------------------------------


@dataclass
class Options:
    dbs: tuple[int, ...] = (1, 2, 4)
    claim_rows: int = 15_000  # per database
    claim_repeats: int = 3
    rows: int = 5_000  # delivery, over all databases
    delivery_repeats: int = 3  # a worker session each
    tx_rows: int = 1_000
    concurrency: int = 2
    pool: str = "prefork"
    out: str = ""
    quick: bool = False


QUICK: dict[str, Any] = {
    "claim_rows": 3_000,
    "claim_repeats": 1,
    "rows": 2_000,
    "delivery_repeats": 1,
}


def parse_args(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m bench.multidb",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Options()
    p.add_argument("--quick", action="store_true", help="a smoke run of under a minute")
    p.add_argument("--dbs", default="1,2,4", help="database counts, comma-separated (1,2,4)")
    p.add_argument("--claim-rows", type=int, help=f"due rows per database ({d.claim_rows:,})")
    p.add_argument("--claim-repeats", type=int, help=f"timed claims per count ({d.claim_repeats})")
    p.add_argument("--rows", type=int, help=f"delivered rows over all databases ({d.rows:,})")
    p.add_argument("--delivery-repeats", type=int, help=f"({d.delivery_repeats})")
    p.add_argument("--tx-rows", type=int, default=d.tx_rows, help="rows per transaction")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--pool", default=d.pool, choices=["prefork", "threads"])
    p.add_argument("--out", default="", help="directory for multidb.json (default: a temp dir)")
    a = p.parse_args(argv)
    o = Options(**(QUICK if a.quick else {}))
    o.quick = a.quick
    o.dbs = tuple(sorted({int(x) for x in a.dbs.split(",") if x}))
    for name in ("claim_rows", "claim_repeats", "rows", "delivery_repeats"):
        if getattr(a, name) is not None:
            setattr(o, name, getattr(a, name))
    o.tx_rows, o.concurrency, o.pool = a.tx_rows, a.concurrency, a.pool
    o.out = a.out or tempfile.mkdtemp(prefix="outbox-bench-mdb-")
    if not o.dbs or o.dbs[0] < 1 or o.dbs[-1] > 16:
        p.error("--dbs: counts from 1 to 16")
    if 1 not in o.dbs:
        p.error("--dbs must include 1: the ratios are to one database")
    if o.claim_rows * o.dbs[-1] * 4 > CLAIM_IN_FLIGHT * 3:
        p.error(f"--claim-rows x databases must stay below {CLAIM_IN_FLIGHT * 3 // 4:,}")
    if min(o.claim_rows, o.claim_repeats, o.delivery_repeats, o.tx_rows) < 1:
        p.error("sizes and repeats must be >= 1")
    if o.rows < o.dbs[-1]:
        p.error("--rows must give every database at least one row")
    return o


# -- databases and keys ----------------------------------------------------------------------


@dataclass
class Run:
    """The run's names: its databases (created and dropped here) and its Redis key prefix."""

    run_id: str
    urls: dict[str, str]  # name -> url, in order; the first n serve the n-database figures
    prefix: str
    created: list[str] = field(default_factory=list)

    def first(self, n: int) -> dict[str, str]:
        return dict(list(self.urls.items())[:n])


@contextmanager
def databases(count: int) -> Iterator[Run]:
    """``count`` fresh databases and a key prefix; dropped and deleted on the way out,
    whatever happened."""
    run_id = secrets.token_hex(3)
    prefix = f"od-bench-mdb-{run_id}:"
    urls = {
        f"db{i}": make_conninfo(BASE_URL, dbname=dbname(run_id, i)) for i in range(1, count + 1)
    }
    run = Run(run_id, urls, prefix)
    try:
        with psycopg.connect(BASE_URL, autocommit=True) as conn:
            for i in range(1, count + 1):
                # template0: template1 may be in use by another session, which CREATE refuses
                conn.execute(f"CREATE DATABASE {quoted(dbname(run_id, i))} TEMPLATE template0")
                run.created.append(dbname(run_id, i))
        P.say(f"multidb: created {', '.join(run.created)}; Redis keys {prefix}*")
        yield run
    finally:
        drop(run)


def dbname(run_id: str, i: int) -> str:
    return f"od_bench_mdb_{run_id}_{i}"


def drop(run: Run) -> None:
    """Drop the run's databases (FORCE: a killed worker's sessions may linger) and delete its
    Redis keys; each step is tried even when another failed."""
    try:
        with psycopg.connect(BASE_URL, autocommit=True) as conn:
            for name in run.created:
                try:
                    conn.execute(f"DROP DATABASE IF EXISTS {quoted(name)} WITH (FORCE)")
                except psycopg.Error as exc:
                    P.say(f"multidb: could not drop database {name}: {exc}")
        P.say(f"multidb: dropped {', '.join(run.created) or 'no databases'}")
    except psycopg.Error as exc:
        P.say(f"multidb: could not connect to drop {run.created}: {exc}")
    try:
        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(match=f"{run.prefix.rstrip(':')}*", count=1000))
        for start in range(0, len(keys), 500):
            r.delete(*keys[start : start + 500])
        P.say(f"multidb: deleted {len(keys)} Redis keys")
    except redis.RedisError as exc:
        P.say(f"multidb: could not delete Redis keys {run.prefix}*: {exc}")


def truncate(urls: dict[str, str]) -> None:
    with_schema = f"{quoted(SCHEMA)}.outbox"
    for url in urls.values():
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {with_schema}")


def outbox_rows(urls: dict[str, str]) -> dict[str, int]:
    out = {}
    for name, url in urls.items():
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {quoted(SCHEMA)}.outbox").fetchone()
        out[name] = int(row[0]) if row else -1
    return out


def enqueue(d: Dispatcher, url: str, command: str, rows: int, db: str, tx_rows: int) -> None:
    """``rows`` rows through ``enqueue_many`` on a connection to ``url``: the dispatcher
    picks the database from the connection, as an application's write would."""
    with psycopg.connect(url) as conn:
        for start in range(0, rows, tx_rows):
            msgs = [
                Message(command, {"db": db, "i": i})
                for i in range(start, min(rows, start + tx_rows))
            ]
            with conn.transaction():
                d.enqueue_many(conn, msgs)


def purge(d: Dispatcher, family: str) -> None:
    """Empty a family's broker queue (under the run's key prefix)."""
    with d.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(d.queue_name(family))


# -- claim -----------------------------------------------------------------------------------


@dataclass
class ClaimFigure:
    databases: int
    mode: str  # serial | parallel
    rows: int  # over all databases
    seconds: list[float]
    ratio: float = 0.0

    @property
    def per_second(self) -> float:
        return self.rows / statistics.median(self.seconds)


def claim_all(d: Dispatcher, names: list[str], rows: int, parallel: bool) -> float:
    """Seconds until every one of ``rows`` due rows per database is claimed and published."""
    errors: list[BaseException] = []

    def loop(database: str | None, target: int) -> None:
        done = idle = 0
        while done < target:
            got = d.runtime.claim_and_publish([CLAIM_FAMILY], database=database).total
            done += got
            idle = 0 if got else idle + 1
            if idle >= 20:  # 20 empty passes: something holds the claims back
                status = [s for s in d.ops.status(database) if s.family == CLAIM_FAMILY]
                raise RuntimeError(
                    f"claims stuck at {done}/{target} in {database or 'every database'}: {status}"
                )
            if not got:
                time.sleep(0.05)

    def guarded(database: str) -> None:
        try:
            loop(database, rows)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.monotonic()
    if parallel:
        threads = [threading.Thread(target=guarded, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    else:
        loop(None, rows * len(names))
    return time.monotonic() - t0


def turn(counts: tuple[int, ...], rep: int) -> tuple[int, ...]:
    """The counts in order, reversed every other repeat: a slow spell of the shared machine
    does not fall on one count only."""
    return counts if rep % 2 == 0 else tuple(reversed(counts))


def due_rows(urls: dict[str, str], rows: int) -> None:
    """``rows`` due rows of the claim family in each database, as ``enqueue`` writes a row
    with no actor, dedupe key or delay (one INSERT: the setup is not what is measured), on an
    empty, analyzed table, so every database starts alike."""
    table_name = f"{quoted(SCHEMA)}.outbox"
    for url in urls.values():
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {table_name}")
            conn.execute(
                f"INSERT INTO {table_name} (family, command, payload)"
                " SELECT %s, 'mdb.claim', jsonb_build_object('i', i)"
                " FROM generate_series(1, %s) AS i",
                (CLAIM_FAMILY, rows),
            )
            conn.execute(f"ANALYZE {table_name}")


def check_published(d: Dispatcher, run: Run, urls: dict[str, str], rows: int) -> None:
    """Every claimed row is in the broker queue once, in a message that names its database
    (none for the first): read back from the queue's Redis list."""
    r = redis.Redis.from_url(REDIS_URL)
    seen: dict[str, list[int]] = {name: [] for name in urls}
    first = next(iter(urls))
    for raw in r.lrange(f"{run.prefix}{d.queue_name(CLAIM_FAMILY)}", 0, -1):
        envelope = json.loads(raw)
        args = json.loads(base64.b64decode(envelope["body"]))[0]
        name = args[0] if args and isinstance(args[0], str) else None
        rest = args[1:] if name is not None else args
        if name == first:
            raise RuntimeError(f"a message of the first database names it: {args!r}")
        ids = [int(p[0]) for p in rest[0]] if isinstance(rest[0], list) else [int(rest[0])]
        seen[name or first] += ids
    for name, ids in seen.items():
        if len(ids) != rows or len(set(ids)) != rows:
            raise RuntimeError(
                f"database {name}: {len(ids)} rows published ({len(set(ids))} distinct), "
                f"{rows} claimed"
            )


def claim_scenario(o: Options, run: Run, dispatchers: dict[int, Dispatcher]) -> list[ClaimFigure]:
    """Every count and mode once per repeat (see ``turn``); the messages are checked after
    each timed claim."""
    figures = {
        (n, mode): ClaimFigure(n, mode, o.claim_rows * n, [])
        for n in o.dbs
        for mode in ("serial", "parallel")
    }
    for n in o.dbs:  # untimed: every database's pools and the broker connection are open
        due_rows(run.first(n), 10)
        claim_all(dispatchers[n], list(run.first(n)), 10, parallel=False)
        purge(dispatchers[n], CLAIM_FAMILY)
    for rep in range(o.claim_repeats):
        for n in turn(o.dbs, rep):
            d, urls = dispatchers[n], run.first(n)
            for mode in ("serial", "parallel"):
                due_rows(urls, o.claim_rows)
                purge(d, CLAIM_FAMILY)
                seconds = claim_all(d, list(urls), o.claim_rows, mode == "parallel")
                check_published(d, run, urls, o.claim_rows)
                purge(d, CLAIM_FAMILY)
                fig = figures[(n, mode)]
                fig.seconds.append(round(seconds, 3))
                P.say(
                    f"claim: {n} db, {mode}, {fig.rows:,} rows in {seconds:.2f} s"
                    f" = {fig.rows / seconds:,.0f} rows/s"
                )
    truncate(run.urls)
    out = list(figures.values())
    for fig in out:
        base = figures[(1, fig.mode)].per_second
        fig.ratio = round(fig.per_second / base, 2) if base else 0.0
    return out


# -- delivery --------------------------------------------------------------------------------


@dataclass
class DeliveryFigure:
    databases: int
    rows: int
    seconds: list[float]
    produce_seconds: list[float]
    per_database: dict[str, int] = field(default_factory=dict)  # deliveries seen, last repeat
    extra_deliveries: int = 0  # over all repeats: deliveries beyond one per row
    ratio: float = 0.0

    @property
    def per_second(self) -> float:
        return self.rows / statistics.median(self.seconds)


def worker_procs(o: Options, run: Run, n: int, logdir: Path) -> list[P.Proc]:
    """The worker and beat of ``n`` databases: the same app as the driver's, from the
    environment."""
    env = {ENV_DATABASES: json.dumps(run.first(n)), ENV_PREFIX: run.prefix}
    celery = [sys.executable, "-m", "celery", "-A", "bench.multidb"]
    worker = [*celery, "worker", "-P", o.pool, "-c", str(o.concurrency), "--loglevel", "WARNING"]
    beat = [*celery, "beat", "--loglevel", "WARNING", "-s", str(logdir / f"beat-{n}-schedule")]
    return [P.Proc(worker, env, "worker"), P.Proc(beat, env, "beat")]


def wait_delivered(
    counters: Counters,
    dbs: list[str],
    target: int,
    label: str,
    procs: list[subprocess.Popen[bytes]],
    t0: float | None = None,
    timeout: float = 300.0,
    stall: float = 60.0,
) -> float:
    """Poll the total counter until ``target``; the monotonic time then."""
    progress = P.Progress(label, target, t0)
    last, last_change = -1, time.monotonic()
    started = time.monotonic()
    try:
        while True:
            done, _ = counters.read(dbs)
            now = time.monotonic()
            if done >= target:
                progress.tick(done, force=True)
                return now
            progress.tick(done)
            if done != last:
                last, last_change = done, now
            if now - last_change > stall or now - started > timeout:
                raise RuntimeError(f"{label}: stuck at {done}/{target} ({counters.read(dbs)[1]})")
            P.check_alive(procs, label)
            time.sleep(0.01)
    finally:
        progress.done()


def wait_gone(urls: dict[str, str], timeout: float = 20.0) -> dict[str, int]:
    """Rows left in each outbox once their settles land (default retention deletes them)."""
    deadline = time.monotonic() + timeout
    while True:
        left = outbox_rows(urls)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def delivery_scenario(
    o: Options, run: Run, dispatchers: dict[int, Dispatcher], logdir: Path, failures: list[str]
) -> list[DeliveryFigure]:
    """One worker session per count and repeat (see ``turn``): a count that fails is
    reported and the others still run."""
    figures = {n: DeliveryFigure(n, (o.rows // n) * n, [], []) for n in o.dbs}
    broken: set[int] = set()
    for rep in range(o.delivery_repeats):
        for n in turn(o.dbs, rep):
            if n in broken:
                continue
            label = f"delivery {n} db, run {rep + 1}"
            ran = attempt(
                failures, label, partial(deliver_n, o, run, dispatchers[n], figures[n], logdir, rep)
            )
            if ran is None:
                broken.add(n)
    out = [f for f in figures.values() if f.seconds and f.databases not in broken]
    base = next((f.per_second for f in out if f.databases == 1), 0.0)
    for fig in out:
        fig.ratio = round(fig.per_second / base, 2) if base else 0.0
    return out


def deliver_n(
    o: Options, run: Run, d: Dispatcher, fig: DeliveryFigure, logdir: Path, rep: int
) -> bool:
    """Start a worker and beat over ``fig.databases`` databases, warm every database's path up
    with one row, then time ``fig.rows`` rows written round-robin in transactions of
    ``tx_rows`` from the first enqueue to the last handler run; checks that each database's
    rows were delivered and are gone."""
    n = fig.databases
    urls = run.first(n)
    names = list(urls)
    per_db = fig.rows // n
    counters = Counters(REDIS_URL, run.prefix)
    truncate(urls)
    counters.reset(names)
    procs = P.start(worker_procs(o, run, n, logdir), logdir, f"delivery-{n}db-{rep + 1}")
    try:
        for name, url in urls.items():  # each database's listener, claim and delivery answer
            enqueue(d, url, "mdb.noop", 1, name, 1)
        wait_delivered(counters, names, n, f"{n} db warm-up", procs, timeout=120, stall=120)
        left = wait_gone(urls)
        if any(left.values()):
            raise RuntimeError(f"warm-up rows not settled: {left}")
        counters.reset(names)
        P.say(f"delivery: {n} db, {fig.rows:,} rows ({per_db:,} per database), run {rep + 1}")
        txs = [name for _ in range(0, per_db, o.tx_rows) for name in names]
        with ExitStack() as stack:
            conns = {k: stack.enter_context(psycopg.connect(u)) for k, u in urls.items()}
            sent = dict.fromkeys(names, 0)
            t0 = time.monotonic()
            for name in txs:
                k = min(o.tx_rows, per_db - sent[name])
                msgs = [Message("mdb.noop", {"db": name, "i": sent[name] + i}) for i in range(k)]
                with conns[name].transaction():
                    d.enqueue_many(conns[name], msgs)
                sent[name] += k
            produced = time.monotonic() - t0
        t1 = wait_delivered(counters, names, fig.rows, f"{n} db", procs, t0=t0)
        left = wait_gone(urls)
        total, each = counters.read(names)
        if any(left.values()) or any(v < per_db for v in each.values()):
            raise RuntimeError(f"{n} db: rows left {left}, delivered per database {each}")
        fig.seconds.append(round(t1 - t0, 3))
        fig.produce_seconds.append(round(produced, 3))
        fig.per_database = each
        fig.extra_deliveries += total - fig.rows
        rate = fig.rows / (t1 - t0)
        P.say(f"  -> {rate:,.0f} rows/s ({t1 - t0:.2f} s, produced in {produced:.2f} s)")
        return True
    finally:
        P.stop(procs)


# -- the run ---------------------------------------------------------------------------------


def attempt(failures: list[str], label: str, fn: Callable[[], Any]) -> Any:
    """Run one part; a failure is said with its traceback and recorded, the rest still runs."""
    try:
        return fn()
    except Exception as exc:
        P.say(f"{label}: FAILED: {exc!r}\n{traceback.format_exc()}")
        failures.append(f"{label}: {exc!r}")
        return None


def run(o: Options) -> dict[str, Any]:
    from bench.run import describe_machine

    t_start = time.monotonic()
    logdir = Path(o.out) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    result: dict[str, Any] = {
        "machine": describe_machine(redis.Redis.from_url(REDIS_URL), BASE_URL),
        "settings": {k: v for k, v in asdict(o).items() if k != "out"},
    }
    P.say(f"multidb: process logs in {logdir}")
    with databases(max(o.dbs)) as run_:
        dispatchers = {n: build(run_.first(n), run_.prefix) for n in o.dbs}
        try:
            dispatchers[max(o.dbs)].migrate()  # every database's outbox schema
            claims = attempt(failures, "claim", partial(claim_scenario, o, run_, dispatchers))
            deliveries = delivery_scenario(o, run_, dispatchers, logdir, failures)
        finally:
            for d in dispatchers.values():
                d.close()
    result["claim"] = [{**asdict(f), "rows_per_s": round(f.per_second)} for f in claims or []]
    result["delivery"] = [{**asdict(f), "rows_per_s": round(f.per_second)} for f in deliveries]
    result["failures"] = failures
    result["seconds"] = round(time.monotonic() - t_start, 1)
    return result


def render(result: dict[str, Any]) -> str:
    """The two tables: claim rows/s by mode, delivery rows/s, each with its ratio to 1 db."""
    lines = []
    if result["claim"]:
        by = {(c["databases"], c["mode"]): c for c in result["claim"]}
        rows = [
            {
                "databases": str(n),
                "rows": f"{by[(n, 'serial')]['rows']:,}",
                "serial rows/s": f"{by[(n, 'serial')]['rows_per_s']:,}",
                "serial vs 1 db": f"{by[(n, 'serial')]['ratio']:.2f}x",
                "parallel rows/s": f"{by[(n, 'parallel')]['rows_per_s']:,}",
                "parallel vs 1 db": f"{by[(n, 'parallel')]['ratio']:.2f}x",
            }
            for n in sorted({c["databases"] for c in result["claim"]})
        ]
        lines += [
            f"claim and publish, no worker (median of {result['settings']['claim_repeats']};"
            " serial: one pass over every database, parallel: a thread per database)",
            table(rows, list(rows[0])),
        ]
    if result["delivery"]:
        s = result["settings"]
        rows = [
            {
                "databases": str(f["databases"]),
                "rows": f"{f['rows']:,}",
                "rows/s": f"{f['rows_per_s']:,}",
                "vs 1 db": f"{f['ratio']:.2f}x",
                "seconds": ", ".join(f"{x:.2f}" for x in f["seconds"]),
                "produced in": ", ".join(f"{x:.2f}" for x in f["produce_seconds"]),
                "delivered twice": str(f["extra_deliveries"]),
            }
            for f in result["delivery"]
        ]
        lines += [
            f"delivery: celery worker -P {s['pool']} -c {s['concurrency']} and beat, rows in"
            f" transactions of {s['tx_rows']:,} round-robin (median of {s['delivery_repeats']})",
            table(rows, list(rows[0])),
        ]
    lines += [f"FAILED: {failure}" for failure in result["failures"]]
    return "\n".join(lines) + "\n"


def _exit_on_term(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the databases and keys are dropped on the way out."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    o = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    result = run(o)
    Path(o.out, "multidb.json").write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(render(result))
    P.say(f"multidb: done in {result['seconds']:.0f} s; wrote {o.out}/multidb.json")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
