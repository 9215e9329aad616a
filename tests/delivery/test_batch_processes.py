"""A real prefork worker killed (kill -9 of its pool process) in the middle of a batched
message: only the row that was running counts as started and runs again with maybe_applied;
the rows after it run once, as first attempts, when the broker hands the message out again."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from subprocess import Popen

import psycopg
from celery import Celery

from outbox_dispatch import Dispatcher, Message
from outbox_dispatch.core.policy import Family

APP = "tests.apps.batch_app"


def _producer(env: dict[str, str], family: str, **policy: float) -> tuple[Dispatcher, Family]:
    """A dispatcher of the test's own that enqueues (and may claim) the batch_app's rows."""
    app = Celery("producer", broker=env["OUTBOX_TEST_REDIS_URL"], set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": env["OUTBOX_TEST_KEY_PREFIX"]}
    producer = Dispatcher(
        app,
        database_url=env["OUTBOX_TEST_DATABASE_URL"],
        schema=env["OUTBOX_TEST_SCHEMA"],
        listen=False,
    )
    fam = producer.family(family, **policy)  # type: ignore[arg-type]
    producer.declare(f"acc.{family}", family=family)
    return producer, fam


def _worker(spawn: Callable[..., Popen[bytes]], env: dict[str, str], *extra: str) -> Popen[bytes]:
    """A prefork worker of one pool process on the batch_app."""
    args = [sys.executable, "-m", "celery", "-A", APP, "worker", *extra]
    return spawn([*args, "-P", "prefork", "-c", "1", "--loglevel", "INFO"], env, "worker")


def test_a_pool_process_killed_mid_batch_marks_only_the_row_it_was_running(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    env = {**clean_acc, "OUTBOX_DISPATCH_APP": f"{APP}:dispatcher"}
    schema = env["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    producer, family = _producer(env, "batchkill", lease=10, heartbeat_timeout=1)
    with psycopg.connect(url) as conn, conn.transaction():
        ids = producer.enqueue_many(
            conn, [Message("acc.batchkill", {"n": i, "kill": i == 3}) for i in range(8)]
        )
    # one message with all eight rows, published before the worker runs
    claimed = producer.claimer.claim_family(family).claimed
    assert [c.id for c in claimed] == ids
    producer.runtime.publish(family, claimed, size=8)
    producer.close()

    worker = _worker(spawn, env, "-B", "-s", f"/tmp/beat-batch-{schema}")
    deadline = time.monotonic() + 60
    while True:
        with psycopg.connect(url) as conn:
            left = conn.execute(
                f'SELECT count(*) FROM "{schema}".outbox WHERE id = ANY(%s)', (ids,)
            ).fetchone()
            runs = conn.execute(
                f'SELECT row_id, attempt, maybe_applied FROM "{schema}".effects ORDER BY at'
            ).fetchall()
        if left is not None and left[0] == 0:
            break
        assert worker.poll() is None, "worker exited"
        assert time.monotonic() < deadline, f"rows left: {left}, runs: {runs}"
        time.sleep(0.2)

    by_row: dict[int, list[tuple[int, bool]]] = {}
    for row_id, attempt, maybe in runs:
        by_row.setdefault(int(row_id), []).append((int(attempt), bool(maybe)))
    killed = ids[3]
    assert by_row[killed] == [(1, False), (2, True)]  # the running row: again, maybe_applied
    for row_id in ids[4:]:  # never begun before the kill: one run, a first attempt
        assert by_row[row_id] == [(1, False)], (row_id, by_row[row_id])
    for row_id in ids[:3]:  # done before the kill; a settle still in flight runs again, flagged
        first, *again = by_row[row_id]
        assert first == (1, False) and all(maybe for _, maybe in again)


def _runs(url: str, schema: str) -> list[tuple[int, int, bool, float]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            f"SELECT row_id, attempt, maybe_applied, extract(epoch FROM at)::float8"
            f' FROM "{schema}".effects ORDER BY at'
        ).fetchall()
    return [(int(r), int(a), bool(m), float(t)) for r, a, m, t in rows]


def test_a_worker_killed_with_claimed_rows_loses_none_and_marks_none_as_started(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """A worker killed with -9 while its one process runs a row and claimed one-row messages
    wait for it (prefetched, or in the broker) loses none: they never started, so they run
    once each as first attempts on the next worker; the row that was running runs again,
    maybe_applied."""
    env = {**clean_acc, "OUTBOX_DISPATCH_APP": f"{APP}:dispatcher"}
    schema = env["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    lease = 5.0
    producer, _family = _producer(
        env, "feedkill", batch=1, lease=lease, heartbeat_timeout=1, max_in_flight=40
    )
    first = _worker(spawn, env)  # no beat: the worker's own listener claims
    try:
        with psycopg.connect(url) as conn, conn.transaction():
            [warm] = producer.enqueue_many(conn, [Message("acc.feedkill", {"n": -1})])
        deadline = time.monotonic() + 60
        while not any(r[0] == warm for r in _runs(url, schema)):  # the worker is up
            assert first.poll() is None, "worker exited"
            assert time.monotonic() < deadline, "the warm-up row was never delivered"
            time.sleep(0.1)
        with psycopg.connect(url) as conn, conn.transaction():
            [blocked] = producer.enqueue_many(conn, [Message("acc.feedkill", {"block": True})])
        while not any(r[0] == blocked for r in _runs(url, schema)):  # its one process is busy
            assert time.monotonic() < deadline, "the blocking row never started"
            time.sleep(0.05)
        with psycopg.connect(url) as conn, conn.transaction():
            ids = producer.enqueue_many(
                conn, [Message("acc.feedkill", {"n": i}) for i in range(40)]
            )
        time.sleep(1.0)  # claimed and published
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        assert _runs(url, schema)[-1][0] == blocked  # nothing ran behind the blocking row
        _worker(spawn, env, "-n", f"second-{schema}@%h")
    finally:
        producer.close()
    deadline = time.monotonic() + 60
    while True:
        runs = [r for r in _runs(url, schema) if r[0] in ids or r[0] == blocked]
        if {r[0] for r in runs} == {*ids, blocked} and len(runs) == len(ids) + 2:
            break
        assert time.monotonic() < deadline, f"runs so far: {runs}"
        time.sleep(0.2)
    by_row: dict[int, list[tuple[int, bool, float]]] = {}
    for row_id, attempt, maybe, at in runs:
        by_row.setdefault(row_id, []).append((attempt, maybe, at))
    assert [(a, m) for a, m, _ in by_row[blocked]] == [(1, False), (2, True)]
    for row_id in ids:  # claimed, never started before the kill: one run, a first attempt
        assert [(a, m) for a, m, _ in by_row[row_id]] == [(1, False)], by_row[row_id]
