"""The benchmark's Celery app: a plain no-op task and a no-op outbox handler, both counting
in Redis, so both sides do the same work per delivery."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import redis
from celery import Celery

from bench.ablation import NODES, switch_off
from bench.procs import COUNTER, LATENCIES
from outbox_dispatch import Context, Dispatcher

DATABASE_URL = os.environ.get(
    "OUTBOX_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/6")
SCHEMA = os.environ.get("OUTBOX_BENCH_SCHEMA", "outbox_bench")

app = Celery("outbox_bench", broker=REDIS_URL)
app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False)
# claim_interval is the default (1 s): the commit wake claims, beat is the safety net
# bench/ablation.py switches mechanisms off in the worker through OUTBOX_BENCH_OFF
OFF = [name for name in os.environ.get("OUTBOX_BENCH_OFF", "").split(",") if name]
NODE = os.environ.get("OUTBOX_BENCH_NODE")  # a worker node's name, to count its share
dispatcher = Dispatcher(
    app,
    database_url=DATABASE_URL,
    redis_url=REDIS_URL,
    schema=SCHEMA,
    flushed_starts="unflushed" in OFF,
)
switch_off(OFF, dispatcher)
_counter: redis.Redis | None = None
_counter_pid = 0


def bump() -> None:
    bump_client().incr(COUNTER)
    if NODE is not None:
        bump_client().hincrby(NODES, NODE, 1)


def note_latency(sent: float) -> None:
    """Seconds from the producer's commit (or publish) to this handler's start."""
    bump_client().rpush(LATENCIES, time.time() - sent)


def bump_client() -> redis.Redis:
    global _counter, _counter_pid
    if _counter is None or _counter_pid != os.getpid():
        _counter, _counter_pid = redis.Redis.from_url(REDIS_URL), os.getpid()
    return _counter


@app.task(name="bench.noop", ignore_result=True)  # type: ignore[untyped-decorator]
def noop(n: int) -> None:
    bump()


@app.task(name="bench.latency", ignore_result=True)  # type: ignore[untyped-decorator]
def plain_latency(sent: float) -> None:
    note_latency(sent)
    bump()


# What each throughput scenario measures (see bench/report.py for the names):
dispatcher.family("default")  # nothing set, as a user declares one: sized per claim
dispatcher.family("single", batch=1)  # one row per message
dispatcher.family("uncapped")
dispatcher.family("capped", per_actor=4)
dispatcher.family("uncapped1", batch=1)
dispatcher.family("capped1", per_actor=4, batch=1)
dispatcher.family("batched", lease=60, max_in_flight=2000, batch=50)  # the RSS scenario


def outbox_noop(ctx: Context, payload: Any) -> None:
    bump()


for _family in ("default", "single", "uncapped", "capped", "uncapped1", "capped1", "batched"):
    dispatcher.handler(f"bench.{_family}", family=_family)(outbox_noop)

# Backpressure: slow handlers on a short lease, the claim limited to the family's free capacity.
# The scenario sets these through the environment of the worker it starts.
BP_HANDLER_MS = float(os.environ.get("OUTBOX_BENCH_BP_HANDLER_MS", "5"))
BP_MAX_IN_FLIGHT = int(os.environ.get("OUTBOX_BENCH_BP_MAX_IN_FLIGHT", "100"))
BP_LEASE = float(os.environ.get("OUTBOX_BENCH_BP_LEASE", "5"))
DELIVERIES = f'"{SCHEMA}".bench_deliveries'
dispatcher.family("bp", lease=BP_LEASE, max_in_flight=BP_MAX_IN_FLIGHT, max_attempts=None)
_recorder: psycopg.Connection[tuple[object, ...]] | None = None
_recorder_pid = 0


def record_delivery(row_id: int, attempt: int) -> None:
    """One row in the deliveries table per handler run: a row delivered twice shows as two."""
    global _recorder, _recorder_pid
    if _recorder is None or _recorder_pid != os.getpid():
        _recorder = psycopg.connect(DATABASE_URL, autocommit=True)
        # the bookkeeping need not wait for its WAL flush: it is measurement, not the system
        _recorder.execute("SET synchronous_commit = off")
        _recorder_pid = os.getpid()
    _recorder.execute(
        f"INSERT INTO {DELIVERIES} (row_id, attempt, pid) VALUES (%s, %s, %s)",
        (row_id, attempt, os.getpid()),
    )


@dispatcher.handler("bench.bp", family="bp")
def outbox_slow(ctx: Context, payload: Any) -> None:
    record_delivery(ctx.row_id, ctx.attempt)
    time.sleep(BP_HANDLER_MS / 1000)
    bump()


@dispatcher.handler("bench.latency", family="default")
def outbox_latency(ctx: Context, payload: Any) -> None:
    note_latency(payload["sent"])
    bump()
