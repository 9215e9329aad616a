"""A real `celery worker` process as a user runs it: rows committed while no worker runs are
delivered once it starts, the commit listener fails over when its worker is killed, and a
worker without beat delivers through the commit wake."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from subprocess import Popen

import psycopg
from celery import Celery

from outbox_dispatch import Dispatcher
from tests.fixtures.processes import cli


def _producer(env: dict[str, str]) -> Dispatcher:
    """A producer service: it declares the commands it sends; handlers live in the worker."""
    app = Celery("producer", broker=env["OUTBOX_TEST_REDIS_URL"], set_as_current=False)
    d = Dispatcher(
        app, database_url=env["OUTBOX_TEST_DATABASE_URL"], schema=env["OUTBOX_TEST_SCHEMA"]
    )
    d.family("custom", max_attempts=2)
    d.declare("acc.email", family="intent")
    d.declare("acc.custom", family="custom")
    return d


def _counts(env: dict[str, str]) -> tuple[int, list[tuple[int, int]]]:
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        live = conn.execute(
            f'SELECT count(*) FROM "{schema}".outbox WHERE parked_at IS NULL'
        ).fetchone()
        per_row = conn.execute(
            f'SELECT row_id, count(*) FROM "{schema}".effects GROUP BY row_id'
        ).fetchall()
    assert live is not None
    return int(live[0]), [(int(r), int(n)) for r, n in per_row]


def test_rows_committed_while_no_worker_runs_are_delivered_once_it_starts(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    env = clean_acc
    producer = _producer(env)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = [producer.enqueue(conn, "acc.email", {"n": i}) for i in range(60)]
        ids += [producer.enqueue(conn, "acc.custom", {"n": i}) for i in range(15)]
        failing = producer.enqueue(conn, "acc.custom", {"fail": True})
    producer.close()
    time.sleep(0.5)
    assert _counts(env) == (76, [])  # nothing runs without a worker

    # a bare worker with an embedded beat: it must consume every outbox queue by itself
    worker = spawn(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.apps.app",
            "worker",
            "-B",
            "-c",
            "2",
            "--loglevel",
            "INFO",
            "-s",
            f"/tmp/beat-{env['OUTBOX_TEST_SCHEMA']}",
        ],
        env,
        "worker",
    )
    deadline = time.monotonic() + 60
    while True:
        live, per_row = _counts(env)
        delivered = {r for r, _ in per_row} - {failing}
        if live == 0 and delivered == set(ids):
            break
        assert worker.poll() is None, "worker exited"
        assert time.monotonic() < deadline, f"not delivered in time: live={live}"
        time.sleep(0.2)
    time.sleep(1.0)  # a duplicate would show up here
    _, per_row = _counts(env)
    counts = dict(per_row)
    assert all(counts[i] == 1 for i in ids), "a row was delivered more than once"
    assert counts[failing] == 2  # the custom family parks after 2 attempts
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0

    parked = json.loads(cli(env, "--json", "parked", "list").stdout)
    assert [p["id"] for p in parked] == [failing]
    assert parked[0]["last_error"] == "RuntimeError: custom handler refuses this payload"


def _listener_holder(env: dict[str, str]) -> int | None:
    """The Postgres backend holding the schema's listener lock (listener.py), if any."""
    lock = f"{env['OUTBOX_TEST_SCHEMA']}.wake-listener"
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(%s, 0)",
            (lock,),
        ).fetchone()
    return None if row is None else int(row[0])


def test_the_listener_fails_over_when_its_worker_is_killed(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """Each worker runs its commit listener in a process of its own; one holds the schema's
    listener lock. The worker that holds it is killed with -9 (its main process alone, as an
    OOM kill does): its listener process finds its parent gone and exits, its session ends,
    and the other worker's listener takes the lock; a commit made after the kill is
    delivered, with no beat running."""
    env = clean_acc

    def worker(name: str) -> Popen[bytes]:
        argv = [sys.executable, "-m", "celery", "-A", "tests.apps.app", "worker"]
        return spawn([*argv, "-c", "1", "-n", f"{name}@%h", "--loglevel", "INFO"], env, name)

    def wait(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    first = worker("first")
    wait("the first worker's listener", lambda: _listener_holder(env) is not None)
    holder = _listener_holder(env)
    second = worker("second")
    time.sleep(3)  # the second worker is up, its listener standing by
    assert _listener_holder(env) == holder and second.poll() is None
    first.send_signal(signal.SIGKILL)  # the main process only: its children are orphaned
    first.wait()
    wait("another listener to take the lock", lambda: _listener_holder(env) not in (None, holder))
    producer = _producer(env)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        row_id = producer.enqueue(conn, "acc.email", {"after": "kill"})
    producer.close()
    wait("the row committed after the kill", lambda: row_id in dict(_counts(env)[1]))
    assert second.poll() is None


def test_a_worker_without_beat_delivers_through_the_commit_wake(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """No beat runs: only the NOTIFY sent at commit can get these rows claimed."""
    env = clean_acc
    worker = spawn(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.apps.app",
            "worker",
            "-c",
            "2",
            "--loglevel",
            "INFO",
        ],
        env,
        "worker",
    )
    time.sleep(3)  # the worker boots and its listener starts
    producer = _producer(env)
    deadline = time.monotonic() + 30
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = [producer.enqueue(conn, "acc.email", {"n": i}) for i in range(5)]
    producer.close()
    while True:
        _, per_row = _counts(env)
        if {r for r, _ in per_row} >= set(ids):
            break
        assert worker.poll() is None, "worker exited"
        assert time.monotonic() < deadline, "rows not delivered without beat"
        time.sleep(0.1)
