"""The chaos run: a private Postgres and Redis, delivery workers (threads and prefork pools)
and two claimers, a producer committing rows (each with a business record in the same
transaction) while workers, pool processes, one claimer or both (their beats with them) are
killed -9 every few seconds and broker connections are cut; once each, at set shares of the
duration: Redis FLUSHDB (data lost, server up), Redis restarted with its data lost, Postgres
killed -9 (crash recovery) and Postgres stopped by a fast shutdown and started. Then every row
must settle (delivered, or parked as planned) within the settle limit of the last fault,
``2 * max(lease, heartbeat_timeout)`` over the run's families; the state of every row that
did not is printed; and every invariant measurable from the records is checked.

``python -m tests.chaos.run --rows 20000 --duration 600`` (``scripts/chaos``).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import psycopg
import redis
from kombu.exceptions import KombuError

from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.store.migrations import migrate

from .checks import Enqueued, Final, Kill, Run, settle_limit
from .fleet import POOLS, Fleet, Member
from .report import SHOWN_ROWS, Facts, Fault, Records, Report, assess, render, state_of
from .services import ServiceError, Services
from .workload import (
    KEEPS_DONE,
    TRANSACTIONAL,
    Planned,
    Settings,
    build,
    plan_workload,
    policies,
    schema_sql,
    with_role,
)

CHUNK = 40  # rows per producer transaction
FINAL_WINDOW = 5.0  # the last fault falls in the last seconds of production


class FaultKind(StrEnum):
    """The faults the run injects; the names are the report's labels."""

    KILL_WORKER = "kill -9 worker"
    KILL_POOL_PROCESS = "kill -9 pool process"
    KILL_TRICKLE = "kill -9 the workers running trickle rows (max_in_flight 2)"
    KILL_CLAIMER = "kill -9 claimer"
    KILL_CLAIMERS = "kill -9 every claimer (both beats)"
    CUT_BROKER = "cut broker connections"
    REDIS_FLUSHDB = "Redis FLUSHDB, server up"
    REDIS_RESTART = "Redis restart, data lost"
    POSTGRES_RESTART = "Postgres restart (kill -9)"
    POSTGRES_FAST = "Postgres fast shutdown and start"


RANDOM_FAULTS = (
    (FaultKind.KILL_WORKER, 0.30),
    (FaultKind.KILL_POOL_PROCESS, 0.15),
    # every worker with a trickle row in progress: the family's whole max_in_flight dies
    # started, which it must get back from dead workers
    (FaultKind.KILL_TRICKLE, 0.10),
    (FaultKind.KILL_CLAIMER, 0.17),
    (FaultKind.KILL_CLAIMERS, 0.08),
    (FaultKind.CUT_BROKER, 0.20),
)
UNSETTLED = (
    "o.parked_at IS NULL AND o.cancelled_at IS NULL AND o.done_at IS NULL"
    " AND NOT (o.blocked AND EXISTS (SELECT 1 FROM {outbox} p WHERE p.family = o.family"
    " AND p.actor = o.actor AND p.parked_at IS NOT NULL))"
)


@dataclass(frozen=True)
class ChaosConfig:
    """What to run: sizes and timing; the workload and the fault sequence follow from the seed
    (the timing of a loaded machine does not)."""

    rows: int = 20000
    duration: float = 600.0
    workers: int = 4
    claimers: int = 2
    seed: int = 1
    fault_interval: float = 4.0  # mean seconds between random faults (jittered ±50 %)
    lease: float = 10.0
    heartbeat_timeout: float = 0.0  # every family's; 0: the lease
    pools: str = "threads,prefork"  # the workers' pools, in turn
    produce_share: float = 1.0  # rows are enqueued evenly over this share of the duration
    redis_restart_at: float = 0.2  # share of the duration
    redis_flush_at: float = 0.33
    postgres_restart_at: float = 0.5
    postgres_fast_at: float = 0.67
    settle_timeout: float = 0.0  # 0: max(30 s, 3 settle limits) after the last fault
    logdir: str = ""
    schema: str = "chaos"  # the fault matrix gives each cell its own
    claim_interval: float = 0.5
    pool_size: int = 6  # Postgres connections per worker process
    record_clock: str = "local"  # run records' times: "local", or "postgres" (workload.py)
    chunk: int = CHUNK  # rows per producer transaction

    @property
    def pool_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.pools.split(",") if p.strip())


class Producer(threading.Thread):
    """Commits the planned rows evenly over a time window, ``CHUNK`` rows per transaction, each
    row with its business record (``chaos_enqueued``). After a failed commit it reads back which
    rows committed (the record commits with the rows, so it is the truth) and retries the rest:
    no row is lost or doubled by the producer itself."""

    def __init__(
        self, settings: Settings, plan: list[Planned], window: float, chunk: int = CHUNK
    ) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.settings = settings
        self.plan = plan
        self.window = window
        self.chunk = chunk
        self.stop = threading.Event()
        self.enqueued = 0
        self.retries = 0
        self.first_at = 0.0
        self.done_at = 0.0
        self.error: BaseException | None = None
        _, self.dispatcher = build(with_role(settings, "producer"))
        self.table = settings.table("chaos_enqueued")

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # reported by the orchestrator
            self.error = exc
        finally:
            self.dispatcher.close()

    def _produce(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        t0 = time.monotonic()
        self.first_at = time.time()
        i = 0
        unsure = False
        while i < len(self.plan) and not self.stop.is_set():
            due = t0 + self.window * i / len(self.plan)
            if (wait := due - time.monotonic()) > 0:
                self.stop.wait(wait)
            chunk = self.plan[i : i + self.chunk]
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.settings.database_url, connect_timeout=3)
                if unsure:
                    chunk = self._not_yet_committed(conn, chunk)
                    unsure = False
                if chunk:
                    self._commit(conn, chunk)
            except (psycopg.Error, OutboxError):
                self.retries += 1
                unsure = True
                if conn is not None:
                    conn.close()
                conn = None
                self.stop.wait(0.3)
                continue
            i += self.chunk
            self.enqueued = min(i, len(self.plan))
        self.done_at = time.time()
        if conn is not None:
            conn.close()

    def _not_yet_committed(
        self, conn: psycopg.Connection[Any], chunk: list[Planned]
    ) -> list[Planned]:
        with conn.transaction():
            rows = conn.execute(
                f"SELECT seq FROM {self.table} WHERE seq = ANY(%s)", ([p.seq for p in chunk],)
            ).fetchall()
        have = {int(r[0]) for r in rows}
        return [p for p in chunk if p.seq not in have]

    def _commit(self, conn: psycopg.Connection[Any], chunk: list[Planned]) -> None:
        with conn.transaction():
            ids = self.dispatcher.enqueue_many(conn, [p.message() for p in chunk])
            with conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO {self.table} (seq, row_id, family, actor, permanent, at)"
                    " VALUES (%s, %s, %s, %s, %s, %s)",
                    [
                        (p.seq, row_id, p.family, p.actor, p.permanent, time.time())
                        for p, row_id in zip(chunk, ids, strict=True)
                    ],
                )


class Monitor:
    """The orchestrator's own view of the outbox, on a connection it reopens after a restart."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.outbox = settings.table("outbox")
        self._conn: psycopg.Connection[Any] | None = None

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]] | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(
                    self.settings.database_url, autocommit=True, connect_timeout=3
                )
            return self._conn.execute(sql, params).fetchall()
        except psycopg.Error:
            self.close()
            return None

    def counts(self) -> tuple[int, int, int] | None:
        """(live, claimed, parked) rows."""
        rows = self.query(
            "SELECT count(*) FILTER (WHERE parked_at IS NULL AND cancelled_at IS NULL"
            " AND done_at IS NULL), count(*) FILTER (WHERE claim_token IS NOT NULL),"
            f" count(*) FILTER (WHERE parked_at IS NOT NULL) FROM {self.outbox}"
        )
        if not rows:
            return None
        live, claimed, parked = rows[0]
        return int(live), int(claimed), int(parked)

    def unsettled(self) -> int | None:
        """Rows not delivered, parked or cancelled, except those an ordered line holds behind
        a parked head (they wait for an operator, by design)."""
        rows = self.query(
            f"SELECT count(*) FROM {self.outbox} o WHERE {UNSETTLED.format(outbox=self.outbox)}"
        )
        return None if not rows else int(rows[0][0])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None


class Chaos:
    def __init__(
        self,
        config: ChaosConfig,
        services: Services,
        logdir: Path,
        out: TextIO,
        fleet_env: dict[str, str] | None = None,
    ):
        self.config = config
        self.services = services
        self.logdir = logdir
        self.out = out
        self.tty = out.isatty()
        self.rng = random.Random(config.seed)
        self.settings = Settings(
            database_url=services.postgres.url,
            redis_url=services.redis.url,
            lease=config.lease,
            parent_pid=os.getpid(),
            heartbeat_timeout=config.heartbeat_timeout,
            schema=config.schema,
            claim_interval=config.claim_interval,
            pool_size=config.pool_size,
            record_clock=config.record_clock,
        )
        self.fleet = Fleet(
            self.settings,
            logdir,
            workers=config.workers,
            claimers=config.claimers,
            rng=random.Random(config.seed + 1),
            pools=config.pool_list,
            env=fleet_env,
        )
        self.settle_limit = self._settle_limit()
        self.kinds = [
            k
            for k in FaultKind
            if k is not FaultKind.KILL_POOL_PROCESS or "prefork" in config.pool_list
        ]
        self.unsettled: list[dict[str, str]] = []  # rows unsettled at the settle limit
        self.unsettled_count = 0
        self.monitor = Monitor(self.settings)
        self.faults: list[Fault] = []
        self.kills: list[Kill] = []
        self.crashes: list[str] = []
        self.stranded = 0  # runs in progress that the last fault killed
        self.t0 = 0.0
        self._last_line = 0.0
        self.records: Records | None = None  # what _report read back, for the fault matrix

    def _settle_limit(self) -> float:
        """2 * max(lease, heartbeat_timeout) over the families as this core declares them."""
        app, dispatcher = build(with_role(self.settings, "producer"))
        try:
            return settle_limit(policies(dispatcher))
        finally:
            dispatcher.close()
            app.close()

    # -- phases ------------------------------------------------------------------------------

    def plan(self) -> list[Planned]:
        return plan_workload(self.config.rows, random.Random(self.config.seed), self.config.lease)

    def run(self) -> Report:
        self._prepare()
        plan = self.plan()
        self.fleet.start_all()
        try:
            self._wait_for_fleet()
            producer = Producer(
                self.settings,
                plan,
                self.config.duration * self.config.produce_share,
                self.config.chunk,
            )
            self.t0 = time.monotonic()
            producer.start()
            try:
                self._inject_faults(producer)
                live_at_last_fault = self._live()
                settled_at = self._settle(producer)
            finally:
                producer.stop.set()
                producer.join(timeout=30)
            if producer.error is not None:
                raise RuntimeError(f"the producer failed: {producer.error!r}")
            self._dump()
            return self._report(producer, live_at_last_fault, settled_at)
        finally:
            self.fleet.stop_all()
            self.monitor.close()

    def _prepare(self) -> None:
        migrate(self.settings.database_url, self.settings.schema)
        with psycopg.connect(self.settings.database_url, autocommit=True) as conn:
            for sql in schema_sql(self.settings):
                conn.execute(sql)

    def _wait_for_fleet(self, timeout: float = 120.0) -> None:
        """Start the clock once every worker and claimer answers a ping, so boot time is not
        counted as fault recovery."""
        app, dispatcher = build(with_role(self.settings, "producer"))
        want = {f"{m.name}@" for m in self.fleet.members}
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                dead = self.fleet.exited()
                if dead:
                    log = self.logdir / f"{dead[0].name}.log"
                    raise RuntimeError(f"{dead[0].name} exited while starting: see {log}")
                try:
                    # returns once every member answered, else after the timeout
                    replies = app.control.ping(timeout=1.0, limit=len(want)) or []
                except (redis.RedisError, KombuError, OSError):
                    # a broker connection from before a Redis restart (a matrix cell's)
                    replies = []
                    time.sleep(0.2)
                names = {name.split("@")[0] + "@" for reply in replies for name in reply}
                self._say(f"waiting for the fleet: {len(names & want)}/{len(want)} answer")
                if want <= names:
                    return
            self._say("not every process answered a ping yet; going on")
        finally:
            dispatcher.close()
            app.close()

    def _inject_faults(self, producer: Producer) -> None:
        """Random faults every ``fault_interval`` (jittered) and the four service faults (Redis
        restart and FLUSHDB, Postgres kill -9 and fast shutdown) at their shares of the
        duration; the last fault is a kill -9 of a worker caught running handlers, in
        the last seconds of production. The settle time is then measured from the costliest
        fault (its rows wait for their lease), not from whatever fault happened to come last
        on an idle fleet."""
        cfg = self.config
        forced = sorted(
            [
                (cfg.duration * cfg.redis_restart_at, FaultKind.REDIS_RESTART),
                (cfg.duration * cfg.redis_flush_at, FaultKind.REDIS_FLUSHDB),
                (cfg.duration * cfg.postgres_restart_at, FaultKind.POSTGRES_RESTART),
                (cfg.duration * cfg.postgres_fast_at, FaultKind.POSTGRES_FAST),
            ]
        )
        # every random kind once, in random order, before the weighted draw takes over
        first = [k for k, _ in RANDOM_FAULTS]
        self.rng.shuffle(first)
        next_at = min(3.0, cfg.fault_interval)
        final_at = cfg.duration - FINAL_WINDOW
        while (now := time.monotonic() - self.t0) < final_at or forced:
            self._keep_fleet()
            if forced and now >= forced[0][0]:
                self._inject(forced.pop(0)[1])
            elif now >= next_at and now < final_at:
                kind = first.pop(0) if first else self._draw()
                self._inject(kind)
                next_at = now + cfg.fault_interval * self.rng.uniform(0.5, 1.5)
            self._progress(producer)
            time.sleep(0.1)
        # handlers are short: a worker seen busy may be idle by the time the kill lands, so
        # kill again (each kill is a fault of its own) until one strands a run in progress,
        # or production ends
        while True:
            victim = None
            while victim is None and time.monotonic() - self.t0 < cfg.duration:
                self._keep_fleet()
                victim = self._busiest_worker()
                time.sleep(0.02)
            while not self.fleet.up("worker", settled_for=3.0):
                self._keep_fleet()
                time.sleep(0.1)
            kill = self._inject(FaultKind.KILL_WORKER, victim=victim)
            self.stranded = self._stranded(kill)
            if self.stranded or time.monotonic() - self.t0 >= cfg.duration:
                return

    def _draw(self) -> FaultKind:
        pick = self.rng.random()
        for kind, weight in RANDOM_FAULTS:
            if pick < weight:
                return kind
            pick -= weight
        return RANDOM_FAULTS[-1][0]

    def _busiest_worker(self) -> Member | None:
        """The running worker with the most handler runs in progress, if any has one."""
        up = {m.proc.pid: m for m in self.fleet.up("worker", settled_for=3.0) if m.proc}
        rows = self.monitor.query(
            f"SELECT pgid, count(*) FROM {self.settings.table('chaos_runs')}"
            " WHERE ended IS NULL AND started > %s GROUP BY pgid ORDER BY 2 DESC",
            (time.time() - self.config.lease,),
        )
        return next((up[int(r[0])] for r in rows or [] if int(r[0]) in up), None)

    def _running(self, family: str, wait: float = 2.0) -> list[Member]:
        """The running workers with a run of ``family`` in progress, waiting up to ``wait``
        seconds for one to have some."""
        deadline = time.monotonic() + wait
        while True:
            up = {m.proc.pid: m for m in self.fleet.up("worker", settled_for=3.0) if m.proc}
            rows = self.monitor.query(
                f"SELECT DISTINCT pgid FROM {self.settings.table('chaos_runs')}"
                " WHERE family = %s AND ended IS NULL AND started > %s",
                (family, time.time() - self.config.lease),
            )
            found = [up[pgid] for pgid in sorted({int(r[0]) for r in rows or []} & set(up))]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _stranded(self, kill: Kill | None) -> int:
        """Runs in progress in the processes a kill took down: they run again after their
        lease."""
        if kill is None or kill.pgid is None:
            return 0
        rows = self.monitor.query(
            f"SELECT count(*) FROM {self.settings.table('chaos_runs')}"
            " WHERE pgid = %s AND ended IS NULL AND started > %s",
            (kill.pgid, kill.at - self.config.lease),
        )
        return int(rows[0][0]) if rows else 0

    def _inject(self, kind: FaultKind, victim: Member | None = None) -> Kill | None:
        """Inject one fault; the kill it made (the last, when it killed several), if any."""
        running = self._running("trickle") if kind is FaultKind.KILL_TRICKLE else []
        at = time.time()
        kill: Kill | None = None
        target = ""
        restart_in = self.rng.uniform(0.5, 3.0)
        if kind is FaultKind.KILL_TRICKLE:
            if running:
                kill, target = self._kill_all(running)
            else:  # no trickle row in progress just now
                kind = FaultKind.KILL_WORKER
        if kind is FaultKind.KILL_POOL_PROCESS:
            prefork = [m for m in self.fleet.up("worker", settled_for=3.0) if m.pool == "prefork"]
            kill = self.fleet.kill_pool_child(self.rng.choice(prefork)) if prefork else None
            if kill is None:
                kind = FaultKind.KILL_WORKER
            else:
                self.kills.append(kill)
                target = f"pid {kill.pid}"
        if kind in (FaultKind.KILL_WORKER, FaultKind.KILL_CLAIMER):
            role = "worker" if kind is FaultKind.KILL_WORKER else "claimer"
            victims = self.fleet.up(role, settled_for=3.0)
            if not victims:
                return None  # every one is still booting after an earlier kill: try later
            victim = victim or self.rng.choice(victims)
            kill = self.fleet.kill(victim, restart_in)
            self.kills.append(kill)
            target = f"{victim.name} (pgid {kill.pgid}, back in {restart_in:.1f} s)"
        elif kind is FaultKind.KILL_CLAIMERS:
            claimers = self.fleet.up("claimer", settled_for=3.0)
            if not claimers:
                return None
            kill, target = self._kill_all(claimers)
        elif kind is FaultKind.CUT_BROKER:
            target = f"{self.services.redis.cut_connections()} connections closed"
        elif kind is FaultKind.REDIS_FLUSHDB:
            keys = self.services.redis.flushdb()
            target = f"port {self.services.redis.port}, {keys} keys gone, connections kept"
        elif kind is FaultKind.REDIS_RESTART:
            self.services.redis.restart(down=1.0)
            target = f"port {self.services.redis.port}, down 1 s"
        elif kind is FaultKind.POSTGRES_RESTART:
            self.services.postgres.restart(down=1.0)
            target = f"port {self.services.postgres.port}, down 1 s, crash recovery"
        elif kind is FaultKind.POSTGRES_FAST:
            how = self.services.postgres.fast_restart(down=1.0)
            target = f"port {self.services.postgres.port}, {how}, down 1 s"
        fault = Fault(round(time.monotonic() - self.t0, 2), at, kind.value, target)
        self.faults.append(fault)
        self._say(f"[{fault.t:6.1f}s] fault: {kind.value} {target}")
        return kill

    def _kill_all(self, members: list[Member]) -> tuple[Kill, str]:
        """kill -9 several members at once, each back after its own delay."""
        parts = []
        for m in members:
            back = self.rng.uniform(0.5, 3.0)
            kill = self.fleet.kill(m, back)
            self.kills.append(kill)
            parts.append(f"{m.name} (pgid {kill.pgid}, back in {back:.1f} s)")
        return kill, ", ".join(parts)

    def _keep_fleet(self) -> None:
        """Restart killed members when their time comes; one that died on its own is a crash
        to report, and is restarted too."""
        for m in self.fleet.exited():
            code = m.proc.returncode if m.proc is not None else None
            self.crashes.append(f"{m.name} exited with {code} at {time.time():.3f}")
            self._say(f"{m.name} exited on its own ({code}): restarting, see its log")
            m.proc = None
            self.fleet.start(m)
        self.fleet.restart_due()

    def _settle(self, producer: Producer) -> float | None:
        """Wait until every committed row is settled; the time it happened, or None. The
        limit counts from the last fault (from the producer's last commit if that came
        later); rows still unsettled when it passes have their state taken then, and the wait
        goes on to ``settle_timeout`` so the report can tell late rows from stuck ones."""
        limit = self.settle_limit
        origin = self.faults[-1].at if self.faults else time.time()
        timeout = self.config.settle_timeout or max(30.0, 3 * limit)
        while producer.is_alive() and time.time() < origin + timeout:
            self._keep_fleet()
            self._progress(producer)
            time.sleep(0.2)
        due = max(origin, producer.done_at if not producer.is_alive() else time.time()) + limit
        snapped = False
        while time.time() < max(origin + timeout, due):
            self._keep_fleet()
            self._progress(producer)
            if not producer.is_alive() and self.monitor.unsettled() == 0:
                return time.time()
            if not snapped and time.time() >= due:
                snapped = self._snapshot(origin)
            time.sleep(0.2)
        self._say(f"the outbox did not settle within {timeout:.0f} s of the last fault")
        return None

    def _snapshot(self, origin: float) -> bool:
        """The full state of the rows not settled when the settle limit passed (the first
        SHOWN_ROWS: started and claimed rows first, they tell why), and how many there are."""
        outbox = self.settings.table("outbox")
        where = UNSETTLED.format(outbox=outbox)
        count = self.monitor.query(f"SELECT count(*) FROM {outbox} o WHERE {where}")
        rows = self.monitor.query(
            f"SELECT to_jsonb(o) FROM {outbox} o WHERE {where}"
            " ORDER BY o.started_at IS NULL, o.claim_token IS NULL, o.id LIMIT %s",
            (SHOWN_ROWS,),
        )
        if not count or rows is None:
            return False  # Postgres unreachable: the next poll tries again
        self.unsettled_count = int(count[0][0])
        self.unsettled = [state_of(r[0], origin) for r in rows]
        self._say(
            f"{self.unsettled_count} rows not settled {self.settle_limit:g} s after the last"
            " fault; their states are in the report"
        )
        return True

    def _live(self) -> int:
        for _ in range(50):
            counts = self.monitor.counts()
            if counts is not None:
                return counts[0]
            time.sleep(0.2)
        return -1

    # -- output ------------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self.tty:
            self.out.write("\r" + line.ljust(120) + "\n")
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def _progress(self, producer: Producer) -> None:
        now = time.monotonic()
        if now - self._last_line < (0.5 if self.tty else 10.0):
            return
        self._last_line = now
        counts = self.monitor.counts()
        kinds = Counter(f.kind for f in self.faults)
        short = " ".join(f"{k.name.lower()} {kinds.get(k.value, 0)}" for k in self.kinds)
        elapsed = now - self.t0
        if counts is None:
            state = "postgres unreachable"
        else:
            live, claimed, parked = counts
            settled = producer.enqueued - live
            state = (
                f"settled {settled} live {live} claimed {claimed} parked {parked}"
                f" {settled / max(elapsed, 1e-9):.0f} rows/s"
            )
        up = f"{len(self.fleet.up('worker'))}w/{len(self.fleet.up('claimer'))}c"
        if nodes := self.fleet.up("node"):
            up += f"/{len(nodes)}n"
        line = (
            f"[{elapsed:6.1f}s] enqueued {producer.enqueued}/{len(producer.plan)} {state}"
            f" | {up} | faults {len(self.faults)}: {short}"
        )
        if self.tty:
            self.out.write("\r" + line[:160].ljust(160))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    # -- the checks --------------------------------------------------------------------------

    def _dump(self) -> None:
        """The run's tables as CSV next to the logs: the private cluster is deleted at the end,
        and a finding must stay reproducible from the files."""
        tables = ("outbox", "chaos_enqueued", "chaos_runs", "chaos_effects")
        try:
            with psycopg.connect(self.settings.database_url, connect_timeout=5) as conn:
                for name in tables:
                    sql = f"COPY {self.settings.table(name)} TO STDOUT WITH (FORMAT csv, HEADER)"
                    with (
                        (self.logdir / f"{name}.csv").open("wb") as out,
                        conn.cursor() as cur,
                        cur.copy(sql) as copy,
                    ):
                        for block in copy:
                            out.write(block)
        except (psycopg.Error, OSError) as exc:
            self._say(f"could not dump the run's tables: {exc}")

    def _fetch(self, sql: str) -> list[tuple[Any, ...]]:
        for _ in range(100):
            rows = self.monitor.query(sql)
            if rows is not None:
                return rows
            time.sleep(0.3)
        raise RuntimeError("the private Postgres stayed unreachable while collecting results")

    def _collect(self) -> Records:
        """Read back what the run left in Postgres."""
        table = self.settings.table
        committed_at: dict[int, float] = {}
        enqueued = []
        for r in self._fetch(
            f"SELECT row_id, family, actor, permanent, at FROM {table('chaos_enqueued')}"
        ):
            enqueued.append(Enqueued(int(r[0]), r[1], r[2], bool(r[3]), r[1] in KEEPS_DONE))
            committed_at[int(r[0])] = float(r[4])
        finals = {
            int(r[0]): Final(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7])
            for r in self._fetch(
                "SELECT id, family, actor, done_at IS NOT NULL, parked_at IS NOT NULL,"
                f" cancelled_at IS NOT NULL, blocked, last_error FROM {table('outbox')}"
            )
        }
        runs: list[Run] = []
        run_family: dict[int, str] = {}
        plain: list[tuple[int, int, bool]] = []  # effects of handlers that are not transactional
        for r in self._fetch(
            "SELECT row_id, family, actor, attempt, maybe_applied, pid, pgid, started, ended,"
            f" ok, told_to_stop, effect_at, gave_up, error FROM {table('chaos_runs')}"
        ):
            run = Run(
                int(r[0]), r[2], int(r[3]), r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[12], r[13]
            )
            runs.append(run)
            run_family[run.row_id] = str(r[1])
            if r[11] is not None and r[1] not in TRANSACTIONAL:
                plain.append((run.row_id, run.attempt, run.maybe_applied))
        txn = [
            (int(r[0]), int(r[1]), bool(r[2]))
            for r in self._fetch(
                f"SELECT row_id, attempt, maybe_applied FROM {table('chaos_effects')}"
            )
        ]
        return Records(enqueued, committed_at, finals, runs, run_family, plain, txn, TRANSACTIONAL)

    def _report(
        self, producer: Producer, live_at_last_fault: int, settled_at: float | None
    ) -> Report:
        if self.tty:
            self.out.write("\n")
        facts = Facts(
            config=asdict(self.config),
            logdir=str(self.logdir),
            fault_kinds=tuple(k.value for k in self.kinds),
            faults=self.faults,
            kills=self.kills,
            crashes=self.crashes,
            planned=len(producer.plan),
            enqueued=producer.enqueued,
            producer_retries=producer.retries,
            first_commit_at=producer.first_at,
            live_at_last_fault=live_at_last_fault,
            stranded_by_last_fault=self.stranded,
            settled_at=settled_at,
            now=time.time(),
            settle_limit=self.settle_limit,
            unsettled=self.unsettled,
            unsettled_count=self.unsettled_count,
        )
        self.records = self._collect()
        return assess(self.records, facts)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_chaos(config: ChaosConfig, out: TextIO) -> Report:
    logdir = (
        Path(config.logdir)
        if config.logdir
        else Path(tempfile.mkdtemp(prefix=f"outbox-chaos-{time.strftime('%Y%m%d-%H%M%S')}-"))
    )
    logdir.mkdir(parents=True, exist_ok=True)
    with Services(logdir) as services:
        out.write(
            f"chaos: private postgres on port {services.postgres.port}, redis on port"
            f" {services.redis.port}; logs in {logdir}\n"
        )
        report = Chaos(config, services, logdir, out).run()
    (logdir / "chaos.json").write_text(json.dumps(report.jsonable(), indent=2))
    return report


def parse(argv: list[str] | None) -> tuple[ChaosConfig, bool]:
    p = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="Deliver a mixed workload through real worker and claimer processes while "
        "killing them, Redis and Postgres; then check every invariant. Other modes, each with "
        "its own options (--help after the mode): --matrix (the fault and pressure matrix), "
        "--rolling (a rolling deploy under load), --failover (the commit listener's failover).",
    )
    d = ChaosConfig()
    p.add_argument("--rows", type=int, default=d.rows, help="rows to enqueue (%(default)s)")
    p.add_argument(
        "--duration",
        type=float,
        default=d.duration,
        help="seconds of faults; rows are enqueued evenly over them (%(default)s)",
    )
    p.add_argument(
        "--workers", type=int, default=d.workers, help="delivery worker processes (%(default)s)"
    )
    p.add_argument(
        "--claimers", type=int, default=d.claimers, help="claimer processes (%(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="workload and fault sequence (%(default)s)"
    )
    p.add_argument(
        "--fault-interval",
        type=float,
        default=d.fault_interval,
        help="mean seconds between random faults, jittered ±50%% (%(default)s)",
    )
    p.add_argument(
        "--lease", type=float, default=d.lease, help="lease of every family, s (%(default)s)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout,
        help="heartbeat_timeout of every family, s (default: the lease)",
    )
    p.add_argument(
        "--pools",
        default=d.pools,
        help="the workers' pools, comma-separated, given in turn (%(default)s)",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=0.0,
        help="seconds after the last fault to wait for rows that missed the settle limit, to"
        " tell late from stuck (default: max(30, 3 settle limits))",
    )
    p.add_argument(
        "--logdir", default="", help="where logs, CSV dumps and chaos.json go (default: a temp dir)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON on stdout, progress on stderr"
    )
    a = p.parse_args(argv)
    if a.rows < 1 or a.duration < 10 or a.workers < 1 or a.claimers < 1 or a.lease < 1:
        p.error("need --rows >= 1, --duration >= 10, --workers >= 1, --claimers >= 1, --lease >= 1")
    pools = [x.strip() for x in a.pools.split(",") if x.strip()]
    if not pools or any(x not in POOLS for x in pools):
        p.error(f"--pools takes {' and '.join(POOLS)}, comma-separated")
    if a.heartbeat_timeout < 0:
        p.error("--heartbeat-timeout must be >= 0 (0: the lease)")
    config = ChaosConfig(
        rows=a.rows,
        duration=a.duration,
        workers=a.workers,
        claimers=a.claimers,
        seed=a.seed,
        fault_interval=a.fault_interval,
        lease=a.lease,
        heartbeat_timeout=a.heartbeat_timeout,
        pools=",".join(pools),
        settle_timeout=a.settle_timeout,
        logdir=a.logdir,
    )
    return config, a.json


MODES = ("--matrix", "--rolling", "--failover")  # each its own parser (matrix.py, deploy.py)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--matrix" in args or "--rolling" in args or "--failover" in args:
        return _other_mode(args)
    config, as_json = parse(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    out = sys.stderr if as_json else sys.stdout
    try:
        report = run_chaos(config, out)
    except KeyboardInterrupt:
        out.write("\nchaos: interrupted; every process it started is stopped\n")
        return 130
    except ServiceError as exc:
        out.write(f"chaos: cannot run: {exc}\n")
        return 2
    if as_json:
        print(json.dumps(report.jsonable(), indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1


def _other_mode(args: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if "--matrix" in args:
            from .matrix import main as matrix_main

            return matrix_main(args)
        from .deploy import main as deploy_main

        return deploy_main(args)
    except KeyboardInterrupt:
        sys.stderr.write("\nchaos: interrupted; every process it started is stopped\n")
        return 130
    except ServiceError as exc:
        sys.stderr.write(f"chaos: cannot run: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
