"""Acceptance tests run the worker, beat and CLI as separate processes, on their own schema and
key prefix (the integration tests' in-process worker must not take their messages)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from outbox_dispatch.store.migrations import migrate
from tests.conftest import drop_run

from .browser import chrome

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def acc_env(database_url: str, redis_url: str, run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_acc_{run_id}"
    prefix = f"od_acc_{run_id}:"
    migrate(database_url, schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".effects (row_id bigint, command text, attempt int,'
            " pid int, maybe_applied boolean, at timestamptz DEFAULT now())"
        )
    env = {
        **os.environ,
        "OUTBOX_TEST_DATABASE_URL": database_url,
        "OUTBOX_TEST_SCHEMA": schema,
        "OUTBOX_TEST_REDIS_URL": redis_url,
        "OUTBOX_TEST_KEY_PREFIX": prefix,
        "OUTBOX_DISPATCH_APP": "tests.acceptance.app:dispatcher",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    yield env
    drop_run(database_url, schema, redis_url, prefix)


@pytest.fixture
def clean_acc(acc_env: dict[str, str]) -> dict[str, str]:
    schema = acc_env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(acc_env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox, "{schema}".effects')
    return acc_env


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start a process in its own session; whatever is left is killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []

    def start(
        args: list[str], env: dict[str, str], name: str, cwd: Path = ROOT
    ) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{name}.log").open("wb")
        logs.append(log)
        p = subprocess.Popen(
            args, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for log in logs:
        log.close()
        # pytest shows a test's captured teardown output only when the test failed: then each
        # process's last lines are in the report (a CI run leaves nothing else behind)
        lines = Path(log.name).read_text(errors="replace").splitlines()
        print(f"--- {Path(log.name).name}, last {min(len(lines), 60)} lines ---")
        print("\n".join(lines[-60:]))


def worker_with_beat(app: str, beat_dir: Path, *extra: str, concurrency: int = 2) -> list[str]:
    """The ``celery -A app worker -B`` command these tests start a worker and beat with."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "-B",
        "-c",
        str(concurrency),
        "--loglevel",
        "INFO",
        "-s",
        str(beat_dir / "beat-schedule"),
        *extra,
    ]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def browser() -> Iterator[Any]:
    with chrome() as driver:
        yield driver
