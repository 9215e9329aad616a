"""A real prefork worker killed (kill -9 of its pool process) in the middle of a batched
message: only the row that was running counts as started and runs again with maybe_applied;
the rows after it run once, as first attempts, when the broker hands the message out again."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import psycopg
from celery import Celery

from outbox_dispatch import Dispatcher, Message
from outbox_dispatch.policy import Family

APP = "tests.acceptance.batch_app"


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
    producer.publish(family, claimed, size=8)
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


def test_a_handed_off_message_whose_pool_process_died_goes_to_the_broker(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]], tmp_path: Path
) -> None:
    """The worker's own commit listener claims a backlog and hands its first message to its
    idle pool process (handoff.py); a handler kills that process mid-message. Celery rejects
    the message for requeue (acks_late, reject_on_worker_lost), and the hand-off publishes it
    to the broker: the row after the killed one runs at once, a first attempt, not after its
    claim's 60 s lease; the killed row runs again after its 1 s run lease, maybe_applied."""
    env = {**clean_acc, "OUTBOX_DISPATCH_APP": f"{APP}:dispatcher"}
    schema = env["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    producer, _family = _producer(env, "handkill", lease=60, heartbeat_timeout=1)
    worker = _worker(spawn, env)  # no beat: the worker's own listener claims
    try:
        with psycopg.connect(url) as conn, conn.transaction():
            [warm] = producer.enqueue_many(conn, [Message("acc.handkill", {"n": -1})])
        deadline = time.monotonic() + 60
        while not any(r[0] == warm for r in _runs(url, schema)):  # the worker is up, and idle
            assert worker.poll() is None, "worker exited"
            assert time.monotonic() < deadline, "the warm-up row was never delivered"
            time.sleep(0.1)
        time.sleep(0.5)
        with psycopg.connect(url) as conn, conn.transaction():
            ids = producer.enqueue_many(
                conn, [Message("acc.handkill", {"n": i, "kill": i == 0}) for i in range(8)]
            )
    finally:
        producer.close()
    deadline = time.monotonic() + 45
    while True:
        runs = [r for r in _runs(url, schema) if r[0] in ids]
        if {r[0] for r in runs} == set(ids) and len(runs) == len(ids) + 1:
            break
        assert worker.poll() is None, "worker exited"
        assert time.monotonic() < deadline, f"runs so far: {runs}"
        time.sleep(0.2)
    by_row: dict[int, list[tuple[int, bool, float]]] = {}
    for row_id, attempt, maybe, at in runs:
        by_row.setdefault(row_id, []).append((attempt, maybe, at))
    killed, after = ids[0], ids[1]  # the first message, two rows, handed off
    assert [(a, m) for a, m, _ in by_row[killed]] == [(1, False), (2, True)]
    assert [(a, m) for a, m, _ in by_row[after]] == [(1, False)]
    assert by_row[after][0][2] - by_row[killed][0][2] < 15  # not after the claim's lease
    assert "handoff_republished" in (tmp_path / "worker.log").read_text(errors="replace")


def test_a_worker_killed_with_rows_fed_to_it_loses_none_and_marks_none_as_started(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """A claim of one-row messages made by the worker's own listener keeps three quarters of
    them for the worker past its prefetch (the local feed, handoff.py). A worker killed with
    -9 while they wait loses none: they are claimed, never started, so they come back after
    their claim's lease as first attempts, not lost ones; the broker's quarter runs at once on
    the next worker; the row that was running runs again, maybe_applied."""
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
        while not any(r[0] == warm for r in _runs(url, schema)):  # up, and its run time known
            assert first.poll() is None, "worker exited"
            assert time.monotonic() < deadline, "the warm-up row was never delivered"
            time.sleep(0.1)
        time.sleep(1.5)  # the claimer reads the reported run times once a second
        with psycopg.connect(url) as conn, conn.transaction():
            [blocked] = producer.enqueue_many(conn, [Message("acc.feedkill", {"block": True})])
        while not any(r[0] == blocked for r in _runs(url, schema)):  # its one process is busy
            assert time.monotonic() < deadline, "the blocking row never started"
            time.sleep(0.05)
        with psycopg.connect(url) as conn, conn.transaction():
            ids = producer.enqueue_many(
                conn, [Message("acc.feedkill", {"n": i}) for i in range(40)]
            )
        time.sleep(1.0)  # claimed: fed to the worker, and the rest published
        os.killpg(first.pid, signal.SIGKILL)
        killed_at = time.time()
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
    late = [i for i in ids if by_row[i][0][2] >= killed_at + lease - 1.5]
    # the fed rows waited out their claim's lease; without the feed only the prefetched few
    # (four for one process) would have
    assert len(late) >= 20, (len(late), sorted(by_row[i][0][2] - killed_at for i in ids))
    assert len(late) <= 34  # the broker's quarter ran at once
