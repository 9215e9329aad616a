"""Runs the demo end to end: fresh schema, worker and beat processes, a mixed workload, a live
progress line and a summary. Stops what it started, also on Ctrl-C.

With ``external=True`` (the compose stack) it only produces and watches: the stack's own
worker and beat deliver, and only rows enqueued by this run are counted.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import redis

from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.tables import table
from outbox_dispatch.core.validation import Message
from outbox_dispatch.dispatcher import Dispatcher

APP = "outbox_dispatch.demo.app"
CHUNK = 250


@dataclass
class Progress:
    delivered: int
    failed_attempts: int
    live: int
    parked: int
    in_flight: int
    waiting_retry: int


OWN_KEYS = ("outbox.*", "outbox:*", "_kombu.*", "unacked*", "celery*")  # what a run leaves


def _reset(database_url: str, schema: str, redis_url: str, force: bool = False) -> None:
    """A clean start: the demo's schema dropped and the queues an earlier, interrupted run
    left cleared. A Redis database holding keys the demo did not make is refused (it would be
    someone else's), unless ``force``."""
    client = redis.Redis.from_url(redis_url)
    try:
        if not force:
            foreign = [
                k.decode(errors="replace")
                for k in itertools.islice(client.scan_iter(count=1000), 10_000)
                if not any(fnmatch.fnmatchcase(k.decode(errors="replace"), p) for p in OWN_KEYS)
            ]
            if foreign:
                raise ConfigurationError(
                    f"Redis {mask_dsn(redis_url)} holds keys the demo did not make "
                    f"({', '.join(sorted(foreign)[:5])}...): point OUTBOX_REDIS_URL at a "
                    "database of its own, or pass --force to clear the demo's keys beside them"
                )
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        for pattern in OWN_KEYS:
            for key in client.scan_iter(pattern):
                client.delete(key)
    finally:
        client.close()


def workload(rows: int, rng: random.Random) -> list[Message]:
    """Half e-mails, 30 % webhooks (a fifth fail once), 20 % reports (one in 20 never works)."""
    out = []
    for i in range(rows):
        kind = rng.random()
        if kind < 0.5:
            out.append(
                Message("email.send", {"to": f"user{i}@example.com"}, actor=f"user:{i % 97}")
            )
        elif kind < 0.8:
            flaky = rng.random() < 0.2
            out.append(
                Message("webhook.post", {"url": f"https://hooks.example/{i}", "flaky": flaky})
            )
        else:
            broken = rng.random() < 0.05
            out.append(Message("report.build", {"report": i, "broken": broken}))
    return out


def _progress(conn: psycopg.Connection[Any], schema: str, baseline: int) -> Progress:
    att = conn.execute(
        f"SELECT count(DISTINCT row_id) FILTER (WHERE ok), count(*) FILTER (WHERE NOT ok)"
        f' FROM "{schema}".demo_attempts WHERE row_id > %s',
        (baseline,),
    ).fetchone()
    rows = conn.execute(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL AND cancelled_at IS NULL"
        " AND done_at IS NULL),"
        " count(*) FILTER (WHERE parked_at IS NOT NULL),"
        " count(*) FILTER (WHERE claim_token IS NOT NULL AND due_at > now()),"
        " count(*) FILTER (WHERE claim_token IS NULL AND due_at > now() AND parked_at IS NULL)"
        f' FROM "{schema}".outbox WHERE id > %s',
        (baseline,),
    ).fetchone()
    assert att is not None
    assert rows is not None
    return Progress(
        int(att[0]), int(att[1]), int(rows[0]), int(rows[1]), int(rows[2]), int(rows[3])
    )


def _start(args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 (the child writes to it until it stops)
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", APP, *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait_for_worker(app: Any, procs: list[subprocess.Popen[bytes]], timeout: float = 30) -> None:
    """Start the clock once the worker answers, so rows/s does not include its boot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return  # _drive reports the dead process
        if app.control.ping(timeout=0.5):
            print("demo: worker is up")
            return
    print("demo: the worker did not answer a ping yet; going on")


def run_demo(
    rows: int = 3000,
    workers: int = 2,
    timeout: float = 180.0,
    external: bool = False,
    events: bool = False,
    force: bool = False,
) -> int:
    from outbox_dispatch.demo import app as demo

    dispatcher = demo.dispatcher
    database_url, schema = dispatcher.database_url, dispatcher.schema
    print(
        f"demo: postgres {mask_dsn(database_url)} schema {schema}, redis {mask_dsn(demo.REDIS_URL)}"
    )
    procs: list[subprocess.Popen[bytes]] = []
    if not external:
        print(
            f"demo: dropping schema {schema} and clearing the queues (outbox.*, _kombu.*, "
            f"unacked*) in Redis {mask_dsn(demo.REDIS_URL)}: both are the demo's own"
        )
        _reset(database_url, schema, demo.REDIS_URL, force)
    dispatcher.migrate()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".demo_attempts (row_id bigint, command text,'
            " attempt int, ok boolean, at timestamptz DEFAULT now())"
        )
    try:
        if not external:
            logdir = tempfile.mkdtemp(prefix="outbox-demo-")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            worker_args = ["worker", "-c", str(workers), "--loglevel", "WARNING", "-n", "demo@%h"]
            worker_args += ["-E"] if events else []  # for a Flower watching the demo
            procs.append(_start(worker_args, env, f"{logdir}/worker.log"))
            beat_args = ["beat", "--loglevel", "WARNING", "-s", f"{logdir}/beat-schedule"]
            procs.append(_start(beat_args, env, f"{logdir}/beat.log"))
            print(f"demo: worker ({workers} processes) and beat started; their logs: {logdir}")
            _wait_for_worker(demo.app, procs)
        return _drive(dispatcher, rows, timeout, procs)
    except KeyboardInterrupt:
        print("\ndemo: interrupted")
        return 130
    finally:
        _stop(procs)
        dispatcher.close()
        if procs:
            print("demo: worker and beat stopped")


def _drive(
    dispatcher: Dispatcher, rows: int, timeout: float, procs: list[subprocess.Popen[bytes]]
) -> int:
    schema = dispatcher.schema
    todo = workload(rows, random.Random(42))
    tty = sys.stdout.isatty()
    with psycopg.connect(dispatcher.database_url, autocommit=True) as conn:
        top = conn.execute(f'SELECT coalesce(max(id), 0) FROM "{schema}".outbox').fetchone()
        baseline = int(top[0]) if top else 0
        t0 = time.monotonic()
        enqueued = 0
        last_print = -1e9
        while True:
            if enqueued < rows:  # a producer committing business transactions of CHUNK rows
                chunk = todo[enqueued : enqueued + CHUNK]
                with conn.transaction():
                    dispatcher.enqueue_many(conn, chunk)
                enqueued += len(chunk)
            p = _progress(conn, schema, baseline)
            elapsed = time.monotonic() - t0
            done = enqueued == rows and p.live == 0
            if done or time.monotonic() - last_print >= (0.25 if tty else 2.0):
                last_print = time.monotonic()
                line = (
                    f"[{elapsed:5.1f}s] enqueued {enqueued}/{rows}  delivered {p.delivered}"
                    f"  in flight {p.in_flight}  waiting retry {p.waiting_retry}"
                    f"  parked {p.parked}  {p.delivered / max(elapsed, 1e-9):.0f} rows/s"
                )
                print("\r" + line.ljust(110) if tty else line, end="" if tty else "\n", flush=True)
            if done:
                break
            if elapsed > timeout or any(proc.poll() is not None for proc in procs):
                print(
                    f"\ndemo: FAILED: {p.live} rows still live after {elapsed:.0f} s, or a "
                    "worker/beat process exited: see their logs"
                )
                return 1
            if enqueued >= rows:
                time.sleep(0.1)
        elapsed = time.monotonic() - t0
        by_command = conn.execute(
            "SELECT command, count(DISTINCT row_id) FILTER (WHERE ok),"
            f' count(*) FILTER (WHERE NOT ok), count(*) FROM "{schema}".demo_attempts'
            " WHERE row_id > %s GROUP BY command ORDER BY command",
            (baseline,),
        ).fetchall()
    if tty:
        print()
    print()
    print(
        table(
            [
                dict(zip(["command", "delivered", "failed", "attempts"], r, strict=True))
                for r in by_command
            ],
            ["command", "delivered", "failed", "attempts"],
        )
    )
    # every failed attempt was retried, except the last one of each parked row
    retried = p.failed_attempts - p.parked
    lost = rows - p.delivered - p.parked
    summary = {
        "enqueued": rows,
        "delivered": p.delivered,
        "retried": retried,
        "parked": p.parked,
        "lost": lost,
        "seconds": f"{elapsed:.1f}",
        "rows/s": f"{p.delivered / elapsed:.0f}",
    }
    print()
    print(table([summary], list(summary)))
    print(
        f"\ndemo: {'OK' if lost == 0 else 'FAILED'}: {p.delivered} delivered, {retried} retried,"
        f" {p.parked} parked, {lost} lost, {p.delivered / elapsed:.0f} rows/s"
    )
    return 0 if lost == 0 else 1
