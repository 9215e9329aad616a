"""The job lifecycle across real worker and beat processes: heartbeats, kill -9, exactly-once
transactional effects, cron from two beats, warm shutdown."""

from __future__ import annotations

import itertools
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from subprocess import Popen
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Dispatcher, Message
from outbox_dispatch.store.migrations import migrate

CELERY = [sys.executable, "-m", "celery", "-A", "tests.apps.lifecycle_app"]


@pytest.fixture
def env(acc_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_life_{run_id}_{random.randrange(10**6)}"
    e = {**acc_env, "OUTBOX_TEST_SCHEMA": schema, "OUTBOX_TEST_KEY_PREFIX": f"{schema}:"}
    migrate(e["OUTBOX_TEST_DATABASE_URL"], schema)
    with psycopg.connect(e["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".runs (row_id bigint, kind text, attempt int,'
            " maybe_applied bool, pid int, tick text, at timestamptz DEFAULT clock_timestamp())"
        )
        conn.execute(f'CREATE TABLE "{schema}".effects (row_id bigint)')
    yield e
    with psycopg.connect(e["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _enqueue(env: dict[str, str], msgs: list[Message]) -> list[int]:
    app = Celery("producer", broker="memory://", set_as_current=False)
    d = Dispatcher(
        app, database_url=env["OUTBOX_TEST_DATABASE_URL"], schema=env["OUTBOX_TEST_SCHEMA"]
    )
    for fam in ("slow", "txn", "load", "limited"):
        d.family(fam)
    for cmd, fam in (
        ("slow.run", "slow"),
        ("txn.write", "txn"),
        ("load.run", "load"),
        ("limited.hang", "limited"),
        ("limited.stubborn", "limited"),
        ("job.slow", "job"),
    ):
        d.declare(cmd, family=fam)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = d.enqueue_many(conn, msgs)
    d.close()
    return ids


def _query(env: dict[str, str], sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        return conn.execute(sql.replace("S.", f'"{env["OUTBOX_TEST_SCHEMA"]}".'), params).fetchall()


def _live(env: dict[str, str]) -> int:
    return int(_query(env, "SELECT count(*) FROM S.outbox WHERE parked_at IS NULL")[0][0])


def _worker(
    spawn: Callable[..., Popen[bytes]],
    env: dict[str, str],
    name: str,
    c: int = 4,
    pool: str = "threads",
) -> Popen[bytes]:
    args = [
        *CELERY,
        "worker",
        "-P",
        pool,
        "-c",
        str(c),
        "-n",
        f"{name}@%h",
        "--loglevel",
        "INFO",
    ]
    return spawn(args, env, name)


def _beat(spawn: Callable[..., Popen[bytes]], env: dict[str, str], name: str) -> Popen[bytes]:
    schedule = f"/tmp/{env['OUTBOX_TEST_SCHEMA']}-{name}"
    return spawn([*CELERY, "beat", "--loglevel", "INFO", "-s", schedule], env, name)


def _wait(check: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_handler_over_twice_as_long_as_its_three_second_lease_runs_once(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    _enqueue(env, [Message("slow.run", {"sleep": 7})])
    _worker(spawn, env, "w1")
    _worker(spawn, env, "w2")
    _beat(spawn, env, "beat")
    _wait(lambda: _live(env) == 0, 40, "the slow row")
    kinds = Counter(k for (k,) in _query(env, "SELECT kind FROM S.runs"))
    assert kinds == {"start": 1, "end": 1}


def test_killed_worker_row_runs_again_after_the_lease_with_maybe_applied(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    [row_id] = _enqueue(env, [Message("slow.run", {"sleep": 60})])
    first = _worker(spawn, env, "doomed")
    _beat(spawn, env, "beat")
    _wait(lambda: bool(_query(env, "SELECT 1 FROM S.runs")), 20, "the first attempt")
    os.killpg(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _worker(spawn, env, "heir")
    _wait(lambda: _live(env) == 0, 30, "the second attempt")
    runs = _query(env, "SELECT kind, attempt, maybe_applied, at FROM S.runs ORDER BY at")
    starts = [r for r in runs if r[0] == "start"]
    assert [(a, m) for _, a, m, _ in starts] == [(1, False), (2, True)]
    gap = (starts[1][3] - starts[0][3]).total_seconds()
    assert gap >= 2.5, f"second attempt came {gap:.1f} s after the first, before the lease"
    assert time.monotonic() - killed_at < 15
    assert row_id


def test_a_killed_workers_started_row_runs_again_within_30_s_at_the_defaults(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """Invariant 13 at the built-in ``job`` family's defaults: its claimed messages may wait
    300 s in the queue, but a started attempt whose worker died runs again once the 30 s
    heartbeat timeout has passed (plus one claim pass), not after the queue lease."""
    _enqueue(env, [Message("job.slow", {"sleep": 120})])
    first = _worker(spawn, env, "doomed")
    _beat(spawn, env, "beat")
    starts = "SELECT attempt, maybe_applied FROM S.runs WHERE kind = 'start' ORDER BY at"
    _wait(lambda: bool(_query(env, starts)), 20, "the first attempt")
    os.killpg(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _worker(spawn, env, "heir")
    rerun = _wait(lambda: len(_query(env, starts)) == 2, 60, "the second attempt")
    print(f"kill -9 to the row running again at the defaults: {rerun:.1f} s")
    assert _query(env, starts) == [(1, False), (2, True)]
    assert 20 < rerun < 33, f"rows ran again {rerun:.1f} s after the kill (timeout 30 s)"
    assert time.monotonic() - killed_at < 60
    _wait(lambda: _live(env) == 0, 10, "the second attempt's settle")


def test_transactional_effects_exist_exactly_once_under_repeated_kill_9(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    # enough rows that five short-lived workers cannot finish them: a backlog now goes out
    # several rows per message, and 200 rows were once all done before the fifth kill
    ids = _enqueue(env, [Message("txn.write", {"sleep": 0.03}) for _ in range(600)])
    _beat(spawn, env, "beat")

    def effects() -> int:
        return int(_query(env, "SELECT count(*) FROM S.effects")[0][0])

    rng = random.Random(3)
    kills = 0
    for round_ in range(5):  # kill the worker mid-run five times, each time once it makes progress
        before = effects()
        w = _worker(spawn, env, f"victim{round_}", c=4)
        _wait(lambda before=before: effects() > before, 30, "progress before the kill")  # type: ignore[misc]
        time.sleep(rng.uniform(0.1, 0.6))
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
        kills += 1
    done_before = effects()
    _worker(spawn, env, "survivor", c=4)
    _wait(lambda: _live(env) == 0, 90, "all transactional rows")
    per_row = dict(_query(env, "SELECT row_id, count(*) FROM S.effects GROUP BY row_id"))
    assert set(per_row) == set(ids)
    assert set(per_row.values()) == {1}, {k: v for k, v in per_row.items() if v != 1}
    assert kills == 5 and 0 < done_before < 600  # the kills really hit work in progress


def test_two_beat_processes_make_one_row_per_tick(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    cron_env = {**env, "OUTBOX_TEST_CRON": "1"}
    _worker(spawn, cron_env, "w")
    beats = [_beat(spawn, cron_env, "beat1"), _beat(spawn, cron_env, "beat2")]
    _wait(lambda: len(_query(env, "SELECT 1 FROM S.runs")) >= 6, 40, "six ticks")
    for b in beats:
        b.send_signal(signal.SIGTERM)
        b.wait(20)
    _wait(lambda: _live(env) == 0, 20, "the last ticks")
    ticks = [t for (t,) in _query(env, "SELECT tick FROM S.runs ORDER BY tick")]
    assert len(ticks) == len(set(ticks)), f"a tick ran twice: {Counter(ticks).most_common(3)}"
    times = [datetime.fromisoformat(t) for t in ticks]
    gaps = {(b - a).total_seconds() for a, b in itertools.pairwise(times)}
    assert gaps == {1.0}, f"ticks were skipped or doubled: {ticks}"


def test_warm_shutdown_under_load_loses_nothing_and_strands_no_row(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    slow_env = {**env, "OUTBOX_TEST_LEASE": "60"}
    ids = _enqueue(env, [Message("load.run", {"sleep": 0.02}) for _ in range(800)])
    leaving = _worker(spawn, slow_env, "leaving")
    _worker(spawn, slow_env, "staying")
    _beat(spawn, slow_env, "beat")
    _wait(lambda: len(_query(env, "SELECT 1 FROM S.runs")) >= 150, 60, "some progress")
    leaving.send_signal(signal.SIGTERM)  # warm shutdown
    assert leaving.wait(30) == 0
    # with a 60 s lease, any row the leaving worker stranded would hold up the end for a minute
    took = _wait(lambda: _live(env) == 0, 40, "the rest of the load")
    per_row = Counter(r for (r,) in _query(env, "SELECT row_id FROM S.runs"))
    assert set(per_row) == set(ids)
    assert max(per_row.values()) == 1
    print(f"rest of the load done {took:.1f} s after the warm shutdown (lease 60 s)")


def _parked(env: dict[str, str]) -> dict[int, str]:
    rows = _query(env, "SELECT id, last_error FROM S.outbox WHERE parked_at IS NOT NULL")
    return {int(i): str(e) for i, e in rows}


def test_hanging_handlers_end_at_the_time_limit_in_prefork_and_park(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """Soft limit: raised inside the handler, the attempt fails and is retried, then parked.
    A handler that swallows the soft limit is killed at the hard limit: its attempts end
    without an outcome and the last one parks the row. The worker serves on."""
    hang, stubborn = _enqueue(
        env,
        [
            Message("limited.hang", {"sleep": 60}),
            Message("limited.stubborn", {"sleep": 60}),
        ],
    )
    worker = _worker(spawn, env, "w1", c=2, pool="prefork")
    _beat(spawn, env, "beat")
    _wait(lambda: len(_parked(env)) == 2, 60, "both hanging rows parked")
    parked = _parked(env)
    assert "time_limit of 1 s" in parked[hang]
    assert "ended without an outcome" in parked[stubborn]
    runs = _query(env, "SELECT row_id, kind, attempt FROM S.runs WHERE kind <> 'ignored'")
    assert sorted(runs) == sorted(
        [(hang, "start", 1), (hang, "start", 2), (stubborn, "start", 1), (stubborn, "start", 2)]
    )
    assert _query(env, "SELECT count(*) FROM S.runs WHERE kind = 'ignored'")[0][0] >= 1
    [after] = _enqueue(env, [Message("load.run", {"sleep": 0.01})])
    _wait(lambda: _live(env) == 0, 30, "a row after the hanging ones")
    assert _query(env, "SELECT kind FROM S.runs WHERE row_id = %s", after) == [("end",)]
    assert worker.poll() is None


def test_hanging_handler_in_a_threads_pool_loses_its_lease_at_the_time_limit(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """Threads cannot be interrupted: the heartbeat stops renewing the lease at the limit, so
    the row is claimed again (maybe_applied) and, after its last attempt, parked."""
    [hang] = _enqueue(env, [Message("limited.hang", {"sleep": 30})])
    _worker(spawn, env, "w1", c=4)
    _beat(spawn, env, "beat")
    _wait(lambda: hang in _parked(env), 40, "the hanging row parked")
    assert "ended without an outcome" in _parked(env)[hang]
    starts = _query(env, "SELECT attempt, maybe_applied FROM S.runs WHERE kind = 'start'")
    assert sorted(starts) == [(1, False), (2, True)]
