"""A real prefork worker killed (kill -9 of its pool process) in the middle of a batched
message: only the row that was running counts as started and runs again with maybe_applied;
the rows after it run once, as first attempts, when the broker hands the message out again."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from subprocess import Popen

import psycopg
from celery import Celery

from outbox_dispatch import Dispatcher, Message


def test_a_pool_process_killed_mid_batch_marks_only_the_row_it_was_running(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    env = {**clean_acc, "OUTBOX_DISPATCH_APP": "tests.acceptance.batch_app:dispatcher"}
    schema = env["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    app = Celery("producer", broker=env["OUTBOX_TEST_REDIS_URL"], set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": env["OUTBOX_TEST_KEY_PREFIX"]}
    producer = Dispatcher(app, database_url=url, schema=schema, listen=False)
    family = producer.family("batchkill", lease=10, heartbeat_timeout=1)
    producer.declare("acc.batchkill", family="batchkill")
    with psycopg.connect(url) as conn, conn.transaction():
        ids = producer.enqueue_many(
            conn, [Message("acc.batchkill", {"n": i, "kill": i == 3}) for i in range(8)]
        )
    # one message with all eight rows, published before the worker runs
    claimed = producer.claimer.claim_family(family).claimed
    assert [c.id for c in claimed] == ids
    producer.publish(family, claimed, size=8)
    producer.close()

    worker = spawn(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.acceptance.batch_app",
            "worker",
            "-B",
            "-s",
            f"/tmp/beat-batch-{schema}",
            "-P",
            "prefork",
            "-c",
            "1",
            "--loglevel",
            "INFO",
        ],
        env,
        "worker",
    )
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
