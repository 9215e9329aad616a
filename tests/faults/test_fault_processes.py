"""Faults that need real processes: a handler that kills its own prefork pool process every
time ends parked after its attempts, not in a crash loop, and the worker keeps serving."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Dispatcher, Message
from outbox_dispatch.store.migrations import migrate

from .test_lifecycle_processes import _query

CELERY = [sys.executable, "-m", "celery", "-A", "tests.apps.fault_app"]
MAX_ATTEMPTS = 3


@pytest.fixture
def env(acc_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_fault_{run_id}_{random.randrange(10**6)}"
    e = {
        **acc_env,
        "OUTBOX_TEST_SCHEMA": schema,
        "OUTBOX_TEST_KEY_PREFIX": f"{schema}:",
        "OUTBOX_TEST_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    }
    url = e["OUTBOX_TEST_DATABASE_URL"]
    migrate(url, schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".runs (row_id bigint, kind text, attempt int,'
            " maybe_applied bool, pid int,"
            " at timestamptz DEFAULT clock_timestamp())"
        )
    yield e
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    client = redis.Redis.from_url(e["OUTBOX_TEST_REDIS_URL"])
    for key in client.scan_iter(f"{schema}:*"):
        client.delete(key)
    client.close()


def _enqueue(env: dict[str, str], msgs: list[Message]) -> list[int]:
    app = Celery("producer", broker="memory://", set_as_current=False)
    d = Dispatcher(
        app, database_url=env["OUTBOX_TEST_DATABASE_URL"], schema=env["OUTBOX_TEST_SCHEMA"]
    )
    d.family("suicide")
    d.declare("fault.suicide", family="suicide")
    d.declare("fault.ok", family="suicide")
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = d.enqueue_many(conn, msgs)
    d.close()
    return ids


def _wait(check: Callable[[], bool], timeout: float, what: str, proc: Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the worker exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_handler_that_kills_its_process_every_time_ends_parked_and_the_worker_serves_on(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]], tmp_path: Path
) -> None:
    ok = [Message("fault.ok", {"i": i}) for i in range(4)]
    ids = _enqueue(env, [*ok, Message("fault.suicide", {}), *ok])
    doomed = ids[len(ok)]
    worker = spawn(
        [*CELERY, "worker", "-P", "prefork", "-c", "2", "-n", "faults@%h", "--loglevel", "INFO"],
        env,
        "worker",
    )
    schedule = f"/tmp/{env['OUTBOX_TEST_SCHEMA']}-beat"
    spawn([*CELERY, "beat", "--loglevel", "INFO", "-s", schedule], env, "beat")

    def parked() -> bool:
        return bool(
            _query(env, "SELECT 1 FROM S.outbox WHERE id = %s AND parked_at IS NOT NULL", doomed)
        )

    _wait(parked, 90, "the self-killing row to be parked", worker)
    [(attempts, lost, maybe_applied, error)] = _query(
        env,
        "SELECT attempts, lost_attempts, maybe_applied, last_error FROM S.outbox WHERE id = %s",
        doomed,
    )
    assert (attempts, lost, maybe_applied) == (MAX_ATTEMPTS, MAX_ATTEMPTS, True)
    assert (
        error == f"attempt {MAX_ATTEMPTS} ended without an outcome (worker died or lease ran out)"
    )
    # each attempt ran once: the message requeued after each kill ran no handler
    starts = _query(
        env, "SELECT attempt, maybe_applied FROM S.runs WHERE row_id = %s ORDER BY at", doomed
    )
    assert starts == [(1, False)] + [(n, True) for n in range(2, MAX_ATTEMPTS + 1)]
    assert (
        len({pid for (pid,) in _query(env, "SELECT pid FROM S.runs WHERE row_id = %s", doomed)})
        == 3
    )

    # the worker survived every kill and keeps serving the same queue
    more = _enqueue(env, [Message("fault.ok", {"after": True}) for _ in range(4)])
    ok_ids = [i for i in ids if i != doomed] + more

    def all_ok() -> bool:
        return len(_query(env, "SELECT 1 FROM S.outbox WHERE parked_at IS NULL")) == 0

    _wait(all_ok, 30, "the ordinary rows", worker)
    per_row = dict(_query(env, "SELECT row_id, count(*) FROM S.runs WHERE kind = 'ok' GROUP BY 1"))
    assert per_row == {i: 1 for i in ok_ids}
    assert [r[0] for r in _query(env, "SELECT id FROM S.outbox")] == [doomed]  # parked, kept

    def log() -> str:
        return (tmp_path / "worker.log").read_text(errors="replace")

    # the main process notices a dead child on its own schedule (about a second), which can
    # come after the claim that parked the row once its lease ran out
    _wait(
        lambda: log().count("exited with 'signal 9 (SIGKILL)'") >= MAX_ATTEMPTS,
        10,
        "the worker to log every kill",
        worker,
    )
    assert log().count("exited with 'signal 9 (SIGKILL)'") == MAX_ATTEMPTS
    assert "row parked at claim: its last attempt ended without an outcome" in log()
    assert f"row_id={doomed}" in log()


def test_a_lone_commits_row_whose_process_dies_runs_again_maybe_applied_each_attempt_once(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """With the worker idle, a lone commit's row is claimed at once and started in a pool
    process, which is then killed with -9. The attempt is lost, not forgotten: the row runs
    again after its lease, flagged maybe_applied, and ends parked once its attempts are spent,
    each attempt run once."""
    worker = spawn(
        [*CELERY, "worker", "-P", "prefork", "-c", "2", "-n", "lone@%h", "--loglevel", "INFO"],
        env,
        "worker",
    )
    (warm,) = _enqueue(env, [Message("fault.ok", {})])  # the worker is up and idle after it

    def ran(row_id: int) -> bool:
        return bool(_query(env, "SELECT 1 FROM S.runs WHERE row_id = %s", row_id))

    _wait(lambda: ran(warm), 60, "the first row to run", worker)
    time.sleep(1.0)  # its settle and acknowledgement: the worker holds no request
    (doomed,) = _enqueue(env, [Message("fault.suicide", {})])
    _wait(
        lambda: bool(
            _query(env, "SELECT 1 FROM S.outbox WHERE id = %s AND parked_at IS NOT NULL", doomed)
        ),
        90,
        "the self-killing row to be parked",
        worker,
    )
    starts = _query(
        env, "SELECT attempt, maybe_applied FROM S.runs WHERE row_id = %s ORDER BY at", doomed
    )
    # the later attempts were claimed by the claim that found the dead attempt's lease run out
    assert starts == [(1, False)] + [(n, True) for n in range(2, MAX_ATTEMPTS + 1)]
