"""What the chaos run delivers: seven families, handlers that record every run, and the rows.

- ``intent`` (retried forever) and ``job`` (bounded attempts, done rows kept): per-row work;
  ``job``'s handler is transactional, its effect commits with the settle.
- ``capped``: at most 2 runs per actor at once; a few hot actors keep their cap full.
- ``ordered``: one actor's rows one at a time, in enqueue order.

The families below model what users do that the four above do not; their handlers are
*polite*: they work in small steps and return early, without their effect, when they see
``ctx.is_cancelled`` (what the docs ask), and record that they did, so a "delivered" settle of
such an attempt shows as a defect.

- ``trickle``: ``max_in_flight`` of 2, runs of 0.2-0.8 s, so kills catch its rows started.
- ``limited``: a ``time_limit`` of a fifth of the lease that some first attempts overrun: a
  threads worker's heartbeat sets ``is_cancelled`` at the hard limit, a prefork worker raises
  SoftTimeLimitExceeded in the handler at the soft one.
- ``polite``: capped at 2 per actor over 20 actors; some runs span heartbeats, so a lapsed cap
  slot reaches them as ``is_cancelled``.

Handlers record each run (start, effect, end, outcome, pid and process group) on their own
connection, retried through a Postgres restart, so a run's record survives everything but the
death of its process; the orchestrator knows when it killed which process.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from celery import Celery

from outbox_dispatch import Backoff, Context, Dispatcher, Message, PermanentFailure
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.naming import quoted

log = logging.getLogger(__name__)

FAMILIES = ("intent", "job", "capped", "ordered", "trickle", "limited", "polite")
COMMANDS = {f: f"chaos.{f}" for f in FAMILIES}
TRANSACTIONAL = frozenset({"job"})
POLITE = frozenset({"trickle", "limited", "polite"})  # return early on ctx.is_cancelled
CAP = 2
CAPPED = ("capped", "polite")  # families capped at CAP runs per actor
TRICKLE_IN_FLIGHT = 2
JOB_RETENTION = 86400.0  # job keeps delivered rows as done: the end state is read, not inferred
KEEPS_DONE = frozenset({"job", "trickle"})  # families whose retention keeps delivered rows
STEP = 0.05  # seconds between a polite handler's looks at ctx.is_cancelled
Effect = Callable[[Context], None]  # what a handler does to the world, once it decided to
DELIVERY_QUEUES = ",".join(f"outbox.{f}" for f in FAMILIES)
CLAIM_QUEUE = "outbox.claim"


@dataclass(frozen=True)
class Settings:
    """Everything a worker, claimer or producer of the run needs; passed to processes as env."""

    database_url: str
    redis_url: str
    schema: str = "chaos"
    lease: float = 10.0
    claim_interval: float = 0.5
    role: str = "worker"  # worker (delivers), claimer (claim queue, beat, wake) or producer
    pool_size: int = 6
    parent_pid: int = 0  # the orchestrator: a process whose orchestrator died kills itself
    heartbeat_timeout: float = 0.0  # given to every family when the core has it; 0: the lease
    # where run records take their times: "local" (time.time() in the handler) or "postgres"
    # (clock_timestamp() of the record's statement), for workers whose wall clock is stepped
    record_clock: str = "local"
    record_url: str = ""  # where run records go (default: database_url)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        return cls(
            database_url=e.get("CHAOS_DATABASE_URL", ""),
            redis_url=e.get("CHAOS_REDIS_URL", ""),
            schema=e.get("CHAOS_SCHEMA", "chaos"),
            lease=float(e.get("CHAOS_LEASE", "10")),
            claim_interval=float(e.get("CHAOS_CLAIM_INTERVAL", "0.5")),
            role=e.get("CHAOS_ROLE", "worker"),
            pool_size=int(e.get("CHAOS_POOL_SIZE", "6")),
            parent_pid=int(e.get("CHAOS_PARENT_PID", "0")),
            heartbeat_timeout=float(e.get("CHAOS_HEARTBEAT_TIMEOUT", "0")),
            record_clock=e.get("CHAOS_RECORD_CLOCK", "local"),
            record_url=e.get("CHAOS_RECORD_URL", ""),
        )

    def env(self) -> dict[str, str]:
        return {
            "CHAOS_DATABASE_URL": self.database_url,
            "CHAOS_REDIS_URL": self.redis_url,
            "CHAOS_SCHEMA": self.schema,
            "CHAOS_LEASE": str(self.lease),
            "CHAOS_CLAIM_INTERVAL": str(self.claim_interval),
            "CHAOS_ROLE": self.role,
            "CHAOS_POOL_SIZE": str(self.pool_size),
            "CHAOS_PARENT_PID": str(self.parent_pid),
            "CHAOS_HEARTBEAT_TIMEOUT": str(self.heartbeat_timeout),
            "CHAOS_RECORD_CLOCK": self.record_clock,
            "CHAOS_RECORD_URL": self.record_url,
        }

    def table(self, name: str) -> str:
        return f"{quoted(self.schema)}.{quoted(name)}"


def schema_sql(settings: Settings) -> list[str]:
    """The run's own tables, next to the outbox: the producer's business record of each row,
    every handler run, and the effects of the transactional handler."""
    return [
        f"CREATE TABLE IF NOT EXISTS {settings.table('chaos_enqueued')} ("
        " seq int PRIMARY KEY, row_id bigint NOT NULL, family text NOT NULL, actor text,"
        " permanent bool NOT NULL, at float8 NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {settings.table('chaos_runs')} ("
        " run_id uuid PRIMARY KEY, row_id bigint NOT NULL, family text NOT NULL, actor text,"
        " attempt int NOT NULL, maybe_applied bool NOT NULL, pid int NOT NULL,"
        " pgid int NOT NULL, started float8 NOT NULL, effect_at float8, ended float8, ok bool,"
        " told_to_stop bool NOT NULL DEFAULT false, gave_up bool NOT NULL DEFAULT false,"
        " error text)",
        f"CREATE TABLE IF NOT EXISTS {settings.table('chaos_effects')} ("
        " row_id bigint NOT NULL, attempt int NOT NULL, maybe_applied bool NOT NULL,"
        " pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    ]


def time_limit_of(lease: float) -> float:
    """The ``limited`` family's time limit: its hard limit (plus a second) stays well inside a
    lease, so an overrun costs no more than the settle limit allows."""
    return round(lease / 5, 3)


def declare_families(d: Dispatcher, lease: float, heartbeat_timeout: float = 0.0) -> None:
    """Every family on one lease and one heartbeat timeout (0: the lease), so "settled within
    2 leases" names one number; short backoff, so a retried row does not outlast the run."""
    quick = Backoff(0.2, 2.0, 0.2)
    common: dict[str, Any] = {
        "lease": lease,
        "backoff": quick,
        "heartbeat_timeout": heartbeat_timeout or lease,
    }
    d.family("intent", max_attempts=None, max_in_flight=400, **common)
    d.family("job", max_attempts=8, retention=JOB_RETENTION, max_in_flight=300, **common)
    d.family("capped", per_actor=CAP, max_attempts=8, max_in_flight=200, **common)
    # retried forever: a parked head would hold its actor's line to the end of the run
    d.family("ordered", ordered=True, max_attempts=None, **common)
    d.family(
        "trickle",
        max_attempts=8,
        retention=JOB_RETENTION,
        max_in_flight=TRICKLE_IN_FLIGHT,
        **common,
    )
    d.family(
        "limited", max_attempts=8, time_limit=time_limit_of(lease), max_in_flight=300, **common
    )
    d.family("polite", per_actor=CAP, max_attempts=8, max_in_flight=200, **common)


def policies(d: Dispatcher) -> list[tuple[float, float | None]]:
    """(lease, heartbeat_timeout) of every family the run declares, as the core holds them."""
    return [(float(d.families[n].lease), float(d.families[n].heartbeat_timeout)) for n in FAMILIES]


class Recorder:
    """Writes run records on a connection of its own per thread, retrying through a Postgres
    restart; writes are idempotent (keyed by run id), so a retried write that had committed
    changes nothing."""

    def __init__(self, settings: Settings, patience: float = 60.0) -> None:
        self.settings = settings
        self.patience = patience
        self._local = threading.local()
        self.runs = settings.table("chaos_runs")
        # a time as the statement gives it: the handler's, or Postgres' clock when the
        # process' own wall clock is not to be trusted (the clock step cell moves it)
        self.db_clock = settings.record_clock == "postgres"
        self.now = "extract(epoch FROM clock_timestamp())::float8" if self.db_clock else "%s"

    def _at(self, at: float) -> tuple[float, ...]:
        return () if self.db_clock else (at,)

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or getattr(self._local, "pid", 0) != os.getpid():
            url = self.settings.record_url or self.settings.database_url
            conn = psycopg.connect(url, autocommit=True, connect_timeout=3)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        deadline = time.monotonic() + self.patience
        while True:
            try:
                self._conn().execute(sql, params)
                return
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                conn = getattr(self._local, "conn", None)
                if conn is not None:
                    conn.close()
                self._local.conn = None
                if time.monotonic() > deadline:
                    raise
                event(log, logging.WARNING, "chaos_record_retry", f"run record: {exc}")
                time.sleep(0.2)

    def start(self, run_id: uuid.UUID, ctx: Context, started: float) -> None:
        self._write(
            f"INSERT INTO {self.runs} (run_id, row_id, family, actor, attempt, maybe_applied,"
            f" pid, pgid, started) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, {self.now})"
            " ON CONFLICT (run_id) DO NOTHING",
            (
                run_id,
                ctx.row_id,
                ctx.family,
                ctx.actor,
                ctx.attempt,
                ctx.maybe_applied,
                os.getpid(),
                os.getpgrp(),
                *self._at(started),
            ),
        )

    def effect_of(self, run_id: uuid.UUID) -> Effect:
        """The effect of a handler that is not transactional: the moment it is on record."""

        def effect(ctx: Context) -> None:
            self._write(
                f"UPDATE {self.runs} SET effect_at = {self.now} WHERE run_id = %s",
                (*self._at(time.time()), run_id),
            )

        return effect

    def end(
        self,
        run_id: uuid.UUID,
        ended: float,
        ok: bool,
        told_to_stop: bool,
        *,
        gave_up: bool = False,
        error: str | None = None,
    ) -> None:
        self._write(
            f"UPDATE {self.runs} SET ended = {self.now}, ok = %s, told_to_stop = %s,"
            " gave_up = %s, error = %s WHERE run_id = %s",
            (*self._at(ended), ok, told_to_stop, gave_up, error, run_id),
        )


class ToldToStop(RuntimeError):
    """The heartbeat found the claim or cap slot gone: the run stops, its settle is refused."""


def _sleep(ctx: Context, seconds: float, *, stoppable: bool) -> None:
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if stoppable and ctx.is_cancelled:
            raise ToldToStop(f"row {ctx.row_id} attempt {ctx.attempt} told to stop")
        time.sleep(min(left, 0.1))


def work(ctx: Context, payload: dict[str, Any], effect: Effect) -> None:
    """A handler's shape: prepare (half the planned time; fail here as planned, or stop when
    told to), take effect (an external call, or a write in the settle's transaction), then
    finish (the other half). A kill after the effect and before the settle leaves an effect
    whose row runs again, with ``maybe_applied`` set. Once the effect is done the handler
    finishes rather than raise: raising would tell the dispatcher that nothing happened."""
    half = payload.get("ms", 10) / 2000.0
    _sleep(ctx, half, stoppable=True)
    if payload.get("permanent"):
        raise PermanentFailure(f"row {ctx.row_id} is planned to fail for good")
    if ctx.attempt <= payload.get("fail", 0):
        raise RuntimeError(f"row {ctx.row_id} planned to fail attempt {ctx.attempt}")
    effect(ctx)
    _sleep(ctx, half, stoppable=False)


def polite_work(ctx: Context, payload: dict[str, Any], effect: Effect) -> bool:
    """A handler that honours ``ctx.is_cancelled`` the way the docs ask: it works in small
    steps and, once told, returns at once without its effect. True when it gave up so.

    It fails (as planned) only after its work, and takes effect as its very last step, so a
    time limit or a cancel never lands between the effect and the return: an attempt either
    did its work or it did not, and the record says which. ``overrun``: the first attempts
    run ``over_ms`` instead, past the family's time limit."""
    ms = payload.get("ms", 10)
    if ctx.attempt <= payload.get("overrun", 0):
        ms = payload.get("over_ms", ms)
    until = time.monotonic() + ms / 1000.0
    while (left := until - time.monotonic()) > 0:
        if ctx.is_cancelled:
            return True
        time.sleep(min(left, STEP))
    if ctx.is_cancelled:
        return True
    if payload.get("permanent"):
        raise PermanentFailure(f"row {ctx.row_id} is planned to fail for good")
    if ctx.attempt <= payload.get("fail", 0):
        raise RuntimeError(f"row {ctx.row_id} planned to fail attempt {ctx.attempt}")
    effect(ctx)
    return False


def recorded(
    recorder: Recorder, effect: Effect | None, *, polite: bool = False
) -> Callable[[Context, Any], None]:
    """A handler whose start is on record before it does anything, and its end after, with
    its own view of how it ended: done, gave up on ``is_cancelled``, or raised what."""

    def handler(ctx: Context, payload: Any) -> None:
        run_id = uuid.uuid4()
        recorder.start(run_id, ctx, time.time())
        act = effect if effect is not None else recorder.effect_of(run_id)
        gave_up = False
        try:
            if polite:
                gave_up = polite_work(ctx, payload, act)
            else:
                work(ctx, payload, act)
        except BaseException as exc:
            error = type(exc).__name__
            recorder.end(run_id, time.time(), False, bool(ctx.is_cancelled), error=error)
            raise
        recorder.end(run_id, time.time(), not gave_up, bool(ctx.is_cancelled), gave_up=gave_up)

    return handler


def build(settings: Settings) -> tuple[Celery, Dispatcher]:
    """The app of every process of the run. Delivery workers do not listen for NOTIFY; the
    claimers do (one of them leads), consume the claim queue and run beat."""
    app = Celery(f"chaos_{settings.role}", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # a worker outlives a Redis restart, never exits
        broker_transport_options={"socket_connect_timeout": 3},
        worker_send_task_events=False,
        worker_enable_remote_control=True,
    )
    dispatcher = Dispatcher(
        app,
        database_url=settings.database_url,
        redis_url=settings.redis_url,
        schema=settings.schema,
        claim_interval=settings.claim_interval,
        pool_size=settings.pool_size,
        key_prefix="chaos",
        listen=settings.role in ("claimer", "node"),
    )
    declare_families(dispatcher, settings.lease, settings.heartbeat_timeout)
    recorder = Recorder(settings)
    effects = settings.table("chaos_effects")

    def in_transaction(ctx: Context) -> None:
        ctx.conn.execute(
            f"INSERT INTO {effects} (row_id, attempt, maybe_applied, pid) VALUES (%s, %s, %s, %s)",
            (ctx.row_id, ctx.attempt, ctx.maybe_applied, os.getpid()),
        )

    for family in FAMILIES:
        txn = family in TRANSACTIONAL
        handler = recorded(recorder, in_transaction if txn else None, polite=family in POLITE)
        dispatcher.handler(COMMANDS[family], family=family, transactional=txn)(handler)
    if settings.parent_pid and settings.role != "producer":
        _watch_parent(settings.parent_pid)
    return app, dispatcher


def _watch_parent(parent: int) -> None:
    """A worker whose orchestrator is gone kills its own process group (pool children too),
    so an interrupted run leaves nothing behind."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="chaos-watchdog", daemon=True).start()


@dataclass(frozen=True)
class Planned:
    """One row of the workload, known before the run: the checks compare against it."""

    seq: int
    family: str
    actor: str | None
    payload: dict[str, Any] = field(default_factory=dict)

    @property
    def permanent(self) -> bool:
        return bool(self.payload.get("permanent"))

    def message(self) -> Message:
        return Message(COMMANDS[self.family], self.payload, actor=self.actor)


SHARES = (
    ("intent", 0.26),
    ("job", 0.22),
    ("capped", 0.20),
    ("ordered", 0.16),
    ("trickle", 0.04),  # about 1 row/s at the default sizes: max_in_flight 2 keeps up
    ("limited", 0.06),
    ("polite", 0.06),
)
CAPPED_ACTORS = 30
HOT_ACTORS = 3  # take 30 % of the capped rows: their cap is full most of the time
ORDERED_ACTORS = 50
POLITE_ACTORS = 20
# of limited rows: the first attempt runs past the time limit; enough that some land on a
# prefork worker (SoftTimeLimitExceeded) and some on a threads one (is_cancelled) in a short run
OVERRUN_SHARE = 0.25


def plan_workload(rows: int, rng: random.Random, lease: float) -> list[Planned]:
    """Handlers of 10-150 ms (so kills find runs in progress); 4 % fail their first attempt
    and 1 % their first two; 0.5 % (not in the ordered family, where a parked head holds the
    line) raise PermanentFailure; 0.3 % of capped and job rows and 5 % of polite ones run for
    35-60 % of a lease, across a heartbeat (lease/3), and the re-run of one stranded by a
    kill still ends within 2 leases of the kill. Trickle rows run 0.2-0.8 s; a quarter of the
    limited rows overrun their time limit fourfold on the first attempt and are quick after."""
    out = []
    for seq in range(rows):
        pick, family = rng.random(), "ordered"
        for name, share in SHARES:
            if pick < share:
                family = name
                break
            pick -= share
        actor: str | None = None
        if family == "capped":
            hot = rng.random() < 0.3
            actor = f"cap{rng.randrange(HOT_ACTORS) if hot else rng.randrange(CAPPED_ACTORS)}"
        elif family == "ordered":
            actor = f"line{rng.randrange(ORDERED_ACTORS)}"
        elif family == "polite":
            actor = f"pol{rng.randrange(POLITE_ACTORS)}"
        payload: dict[str, Any] = {"seq": seq, "ms": rng.randint(10, 150)}
        if family == "trickle":
            payload["ms"] = rng.randint(200, 800)
        elif family == "limited" and rng.random() < OVERRUN_SHARE:
            payload["overrun"] = 1
            payload["over_ms"] = int(time_limit_of(lease) * 4000)
        roll = rng.random()
        if roll < 0.01:
            payload["fail"] = 2
        elif roll < 0.05:
            payload["fail"] = 1
        if family != "ordered" and rng.random() < 0.005:
            payload["permanent"] = True
        long_share = {"capped": 0.003, "job": 0.003, "polite": 0.05}.get(family, 0.0)
        if rng.random() < long_share:
            payload["ms"] = int(lease * 1000 * rng.uniform(0.35, 0.6))
        out.append(Planned(seq, family, actor, payload))
    return out


def with_role(settings: Settings, role: str) -> Settings:
    return replace(settings, role=role)
