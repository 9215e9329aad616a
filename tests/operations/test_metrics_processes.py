"""Prometheus in a prefork worker: the pool's child processes record, the main process serves
their sum (multiprocess mode); and the standalone `outbox-dispatch metrics` server."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import psycopg

from tests.claim.test_processes import _counts, _producer
from tests.operations.test_observability import free_port, scrape


def _wait_scrape(
    port: int, proc: Popen[bytes], timeout: float = 30.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "process exited"
        try:
            return scrape(port)
        except OSError:
            assert time.monotonic() < deadline, "metrics endpoint never answered"
            time.sleep(0.2)


def test_prefork_worker_serves_the_sum_of_its_children(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]], tmp_path: Path
) -> None:
    env = clean_acc
    port = free_port()
    worker = spawn(
        [
            sys.executable, "-m", "outbox_dispatch.ops.cli", "worker",
            "--metrics-port", str(port), "--metrics-dir", str(tmp_path / "prom"),
            "-B", "-c", "2", "--pool", "prefork", "--loglevel", "INFO",
            "-s", str(tmp_path / "beat"),
        ],
        env,
        "worker",
    )  # fmt: skip
    _wait_scrape(port, worker)
    producer = _producer(env)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        for i in range(40):
            producer.enqueue(conn, "acc.email", {"n": i})
    producer.close()
    deadline = time.monotonic() + 60
    while _counts(env)[0] or len(_counts(env)[1]) < 40:
        assert worker.poll() is None, "worker exited"
        assert time.monotonic() < deadline, "not delivered in time"
        time.sleep(0.2)
    samples = _wait_scrape(port, worker)
    db = ("database", "default")
    key = ("outbox_deliveries_total", (db, ("family", "intent"), ("outcome", "delivered")))
    assert samples[key] == 40  # recorded in two child processes, summed by the main one
    pids = {pid for _, _, pid in _effect_pids(env)}
    assert len(pids) == 2, "both pool processes delivered"
    assert samples[("outbox_commit_to_start_seconds_count", (db, ("family", "intent")))] == 40
    assert samples[("outbox_up", (db,))] == 1
    assert samples[("outbox_due", (db, ("family", "intent")))] == 0


def _effect_pids(env: dict[str, str]) -> list[tuple[int, int, int]]:
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        rows = conn.execute(f'SELECT row_id, attempt, pid FROM "{schema}".effects').fetchall()
    return [(int(a), int(b), int(c)) for a, b, c in rows]


def test_metrics_command_serves_gauges(
    clean_acc: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    env = clean_acc
    producer = _producer(env)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        for i in range(7):
            producer.enqueue(conn, "acc.custom", {"n": i})
    producer.close()
    port = free_port()
    server = spawn(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", "metrics", "--port", str(port),
         "--addr", "127.0.0.1"],
        env,
        "metrics",
    )  # fmt: skip
    samples = _wait_scrape(port, server)
    custom = (("database", "default"), ("family", "custom"))
    assert samples[("outbox_due", custom)] == 7
    assert samples[("outbox_oldest_due_age_seconds", custom)] >= 0
    assert samples[("outbox_in_flight", custom)] == 0
