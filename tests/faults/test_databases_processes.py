"""Several databases with real processes: a prefork worker and beat (``celery worker -B -c
2``) serve three databases, and one of them is cut behind the fault proxy while its messages
wait in the queue. The pool processes drop those messages at once instead of waiting for the
cut database, deliver the other two databases' rows, and run the cut database's rows once it
is back, none twice."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen
from typing import Any

import psycopg
import pytest
import redis

from outbox_dispatch.store.migrations import migrate
from tests.apps import databases_app
from tests.conftest import count_rows
from tests.fixtures.processes import worker_with_beat
from tests.support.faultproxy import FaultProxy


@pytest.fixture
def shards(acc_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    base = acc_env["OUTBOX_TEST_DATABASE_URL"]
    names = {short: f"od_mdb_acc_{run_id}_{short}" for short in ("main", "eu", "us")}
    with psycopg.connect(base, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'CREATE DATABASE "{name}"')
    urls = {short: base.rsplit("/", 1)[0] + "/" + name for short, name in names.items()}
    for url in urls.values():
        migrate(url, acc_env["OUTBOX_TEST_SCHEMA"])
    yield urls
    with psycopg.connect(base, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _enqueue(d: Any, url: str, n: int, **kw: Any) -> None:
    with psycopg.connect(url) as conn, conn.transaction():
        for i in range(n):
            d.enqueue(conn, "mdb.record", {"n": i}, **kw)


def test_a_cut_database_stops_only_its_own_rows_in_a_prefork_worker(
    acc_env: dict[str, str],
    shards: dict[str, str],
    spawn: Callable[..., Popen[bytes]],
    tmp_path: Path,
) -> None:
    schema = acc_env["OUTBOX_TEST_SCHEMA"]
    # a key prefix of its own: this worker's queues are the other tests' queue names, and no
    # message of theirs may ever reach it (or one of its messages them)
    acc_env = {**acc_env, "OUTBOX_TEST_KEY_PREFIX": acc_env["OUTBOX_TEST_KEY_PREFIX"] + "mdb:"}
    client = redis.Redis.from_url(acc_env["OUTBOX_TEST_REDIS_URL"], decode_responses=True)
    seen_key = databases_app.seen_key(acc_env)
    client.delete(seen_key)

    def seen() -> list[str]:
        return [str(s) for s in client.lrange(seen_key, 0, -1)]

    with FaultProxy(5432) as proxy:
        urls = {**shards, "us": proxy.url(shards["us"])}
        _app, producer = databases_app.make(urls, acc_env)
        producer.declare("mdb.record")
        _enqueue(producer, urls["us"], 3)
        assert producer.runtime.claim_and_publish(database="us").total == 3  # waiting in the queue
        proxy.cut()
        _enqueue(producer, urls["main"], 5)
        _enqueue(producer, urls["eu"], 5)
        _enqueue(producer, shards["us"], 4, database="us")  # past the proxy: the worker can't
        env = {
            **acc_env,
            "OUTBOX_TEST_DATABASES": json.dumps(urls),
            "OUTBOX_DISPATCH_APP": "tests.apps.databases_app:dispatcher",
        }
        t0 = time.monotonic()
        worker = spawn(worker_with_beat("tests.apps.databases_app", tmp_path), env, "worker")
        _wait(lambda: len(seen()) >= 10, worker, "main's and eu's rows while us is cut")
        cut_delivery = time.monotonic() - t0
        assert sorted({s.split(":")[0] for s in seen()}) == ["eu", "main"]
        assert count_rows(shards["us"], schema) == 7
        proxy.restore()
        _wait(lambda: len(seen()) >= 17, worker, "us's rows after it is back", timeout=60)
        _wait(lambda: count_rows(shards["us"], schema) == 0, worker, "us's rows settled")
    producer.close()
    ran = seen()
    for key in client.scan_iter(acc_env["OUTBOX_TEST_KEY_PREFIX"] + "*"):
        client.delete(key)
    client.close()
    runs = [tuple(s.split(":")[:2]) for s in ran]
    assert len(runs) == len(set(runs)) == 17  # none ran twice
    assert len({s.split(":")[2] for s in ran}) == 2  # both pool processes delivered
    assert all(count_rows(url, schema) == 0 for url in shards.values())
    # the worker's own start (imports, fork, broker) is in this figure too
    assert cut_delivery < 30, f"the cut database held up the others for {cut_delivery:.1f} s"


def _wait(done: Callable[[], bool], worker: Popen[bytes], what: str, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert worker.poll() is None, "the worker exited"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
