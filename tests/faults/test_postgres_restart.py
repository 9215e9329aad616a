"""A Postgres restart under steady delivery, as an operator sees it: a warning, not an incident.
A private Postgres (the suite's own, as the chaos harness starts it) is stopped by a fast
shutdown and started again while a producer commits rows and a real worker with beat delivers
them; no Flower FAILURE event may name a row that was not parked, no process may log an ERROR,
every row committed before the restart must start within 5 s of Postgres accepting
connections again, not after its lease, and the outbox page's first request after it must be
answered, not an error page."""

from __future__ import annotations

import base64
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import DatabaseError, Dispatcher, Message
from outbox_dispatch.store.migrations import migrate
from tests.chaos.services import PrivatePostgres, ServiceError, free_port, preflight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CELERY = [sys.executable, "-m", "celery", "-A", "tests.apps.lifecycle_app"]
LEASE = 300  # a row left to wait its lease would outlast the test by minutes
SCHEMA = "od_restart"
WARNING = re.compile(r": WARNING/([^\]]+)\]")


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[PrivatePostgres]:
    try:
        binaries = preflight()
    except ServiceError as exc:
        pytest.fail(f"the private Postgres cannot start here: {exc}")
    pg = PrivatePostgres(binaries, tmp_path, free_port())
    pg.init()
    pg.start()
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture
def env(postgres: PrivatePostgres, acc_env: dict[str, str]) -> dict[str, str]:
    migrate(postgres.url, SCHEMA)
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {SCHEMA}.runs (row_id bigint, kind text, attempt int,"
            " maybe_applied bool, pid int, tick text, at timestamptz DEFAULT clock_timestamp())"
        )
    return {
        **acc_env,
        "OUTBOX_TEST_DATABASE_URL": postgres.url,
        "OUTBOX_TEST_SCHEMA": SCHEMA,
        "OUTBOX_TEST_LEASE": str(LEASE),
    }


class Producer(threading.Thread):
    """Commits one row a transaction, ``rate`` a second, until stopped; a commit that fails
    while Postgres is down is the app's failed transaction: nothing was written, and it is not
    counted."""

    def __init__(self, env: dict[str, str], rate: float) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.rate = rate
        self.committed: list[tuple[int, float]] = []  # (row id, wall time of the commit)
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        app = Celery("producer", broker="memory://", set_as_current=False)
        d = Dispatcher(app, database_url=self.env["OUTBOX_TEST_DATABASE_URL"], schema=SCHEMA)
        d.family("load")
        d.declare("load.run", family="load")
        while not self.stop.is_set():
            try:
                with psycopg.connect(
                    self.env["OUTBOX_TEST_DATABASE_URL"], connect_timeout=2
                ) as conn:
                    with conn.transaction():
                        [row] = d.enqueue_many(conn, [Message("load.run", {"sleep": 0.12})])
                    self.committed.append((row, time.time()))
            except (psycopg.OperationalError, DatabaseError):
                self.failed += 1
            self.stop.wait(1 / self.rate)
        d.close()


class FailedEvents(threading.Thread):
    """Every task-failed event the broker carries, as Flower would receive it."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.app = Celery("watcher", broker=env["OUTBOX_TEST_REDIS_URL"], set_as_current=False)
        self.app.conf.broker_transport_options = {"global_keyprefix": env["OUTBOX_TEST_KEY_PREFIX"]}
        self.failed: list[dict[str, Any]] = []
        self.ready = threading.Event()

    def run(self) -> None:
        with self.app.connection() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"task-failed": self.failed.append})
            self.ready.set()
            receiver.capture(limit=None, timeout=None, wakeup=True)


def _query(env: dict[str, str], sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        return conn.execute(sql).fetchall()


def _page(port: int) -> str:
    """The status page, asked once."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/")
    request.add_header("Authorization", "Basic " + base64.b64encode(b"ops:s3cret").decode())
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (http only)
        assert response.status == 200
        return str(response.read().decode())


def _answers(port: int) -> bool:
    try:
        return "outbox" in _page(port)
    except OSError:
        return False


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_postgres_restart_under_steady_delivery_is_a_warning_not_an_incident(
    env: dict[str, str],
    postgres: PrivatePostgres,
    spawn: Callable[..., Popen[bytes]],
    tmp_path: Path,
) -> None:
    events = FailedEvents(env)
    events.start()
    assert events.ready.wait(10)
    for name, pool in (("prefork", "prefork"), ("threads", "threads")):
        spawn(
            [*CELERY, "worker", "-P", pool, "-c", "2", "-n", f"{name}@%h", "-E", "-l", "INFO"],
            env,
            name,
        )
    port = free_port()
    spawn(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", "web", "--port", str(port)],
        {
            **env,
            "OUTBOX_DISPATCH_APP": "tests.apps.lifecycle_app:dispatcher",
            "OUTBOX_WEB_AUTH": "ops:s3cret",
        },
        "web",
    )
    _wait(lambda: _answers(port), 30, "the outbox page")
    schedule = tmp_path / "beat-schedule"
    spawn([*CELERY, "beat", "--loglevel", "INFO", "-s", str(schedule)], env, "beat")
    producer = Producer(env, rate=20)
    producer.start()
    _wait(lambda: len(_query(env, f"SELECT 1 FROM {SCHEMA}.runs")) >= 60, 60, "steady delivery")
    postgres.fast_restart(down=2.0)
    up = time.time()  # fast_restart returns once Postgres accepts connections again
    page = _page(port)  # its pooled connection was ended: found, replaced, answered
    assert "msg warn" not in page, page
    time.sleep(8)
    producer.stop.set()
    producer.join(10)
    before = [row for row, at in producer.committed if at < up]
    _wait(
        lambda: not _query(env, f"SELECT 1 FROM {SCHEMA}.outbox LIMIT 1"),
        60,
        "every row delivered",
    )

    parked = _query(env, f"SELECT id FROM {SCHEMA}.outbox WHERE parked_at IS NOT NULL")
    assert not parked
    assert not events.failed, f"FAILURE events for rows that were not parked: {events.failed}"
    first_start = {
        int(r): float(t)
        for r, t in _query(
            env, f"SELECT row_id, extract(epoch FROM min(at)) FROM {SCHEMA}.runs GROUP BY row_id"
        )
    }
    assert set(first_start) == {row for row, _ in producer.committed}
    late = {row: first_start[row] - up for row in before if first_start[row] > up + 5}
    assert not late, f"rows committed before the restart started late (s after it): {late}"
    runs = _query(env, f"SELECT row_id, maybe_applied FROM {SCHEMA}.runs")
    assert len(runs) == len(first_start), "a row ran twice: a fast shutdown loses no settle"
    assert not [r for r, flagged in runs if flagged], "a clean restart flagged rows"
    for name in ("prefork", "threads", "beat", "web"):
        lines = (tmp_path / f"{name}.log").read_text(errors="replace").splitlines()
        errors = [line for line in lines if " ERROR" in line or "ERROR/" in line]
        assert not errors, f"{name} logged errors:\n" + "\n".join(errors[:20])
        # one line per process says the database went away (the commit listener's process
        # also says it lost its LISTEN)
        warned = Counter(m.group(1) for m in map(WARNING.search, lines) if m)
        assert all(n <= 2 for n in warned.values()), f"{name} warned: {warned}"
