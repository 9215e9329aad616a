"""Pausing a family stops its claims, plain and capped, on every worker and across restarts
(it is a row in Postgres); enqueues still commit, and a resume claims the backlog at once.
The CLI, status and the gauges say so."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Dispatcher, InvalidArgument
from outbox_dispatch.observe.metrics import OutboxCollector
from tests.conftest import count_rows
from tests.fixtures.inprocess import dispatcher_under
from tests.fixtures.processes import cli, worker_with_beat


def _gauge(dispatcher: Dispatcher, family: str) -> float:
    for metric in OutboxCollector(dispatcher).collect():
        if metric.name == "outbox_paused":
            return float(next(s.value for s in metric.samples if s.labels["family"] == family))
    raise AssertionError("no outbox_paused gauge")


def test_a_paused_family_is_not_claimed_until_resumed(database_url: str, redis_url: str) -> None:
    ran: list[tuple[str, int]] = []
    with dispatcher_under("", database_url, redis_url, "pause") as (d, _url):
        d.migrate()
        d.family("pausable")
        d.family("pausable_capped", per_actor=1)
        d.family("running")
        for command, family in (
            ("p.plain", "pausable"),
            ("p.capped", "pausable_capped"),
            ("p.other", "running"),
        ):
            d.handler(command, family=family)(
                lambda ctx, payload: ran.append((ctx.command, ctx.row_id))
            )
        with psycopg.connect(database_url) as conn, conn.transaction():
            before = d.enqueue(conn, "p.plain", {"n": 0})
        d.ops.pause("pausable", reason="partner API down", by="test")
        d.ops.pause("pausable_capped", by="test")
        with psycopg.connect(database_url) as conn, conn.transaction():  # enqueues still commit
            held = [d.enqueue(conn, "p.plain", {"n": i}) for i in range(1, 4)]
            held.append(d.enqueue(conn, "p.capped", {"n": 9}, actor="shop:1"))
            other = d.enqueue(conn, "p.other", {})
        d.drain(timeout=10)
        assert ran == [("p.other", other)]  # another family runs meanwhile
        status = {s.family: s for s in d.ops.status()}
        assert status["pausable"].paused and status["pausable"].due == 4
        assert not status["running"].paused
        assert _gauge(d, "pausable") == 1.0
        # another Dispatcher on the same schema (another worker, a restart) sees the pause
        other_d = Dispatcher(
            Celery("other", broker="memory://", set_as_current=False),
            database_url=database_url,
            schema=d.schema,
            listen=False,
        )
        try:
            other_d.family("pausable")
            paused = other_d.ops.paused()
            assert [p["family"] for p in paused] == ["pausable", "pausable_capped"]
            assert paused[0]["reason"] == "partner API down"
        finally:
            other_d.close()
        assert d.ops.resume("pausable") and d.ops.resume("pausable_capped")
        assert not d.ops.resume("pausable")  # not paused any more
        d.drain(timeout=10)
        assert sorted(r for c, r in ran if c == "p.plain") == sorted([before, *held[:3]])
        assert [r for c, r in ran if c == "p.capped"] == [held[3]]
        assert _gauge(d, "pausable") == 0.0
        with pytest.raises(InvalidArgument, match="no family 'nope'"):
            d.ops.pause("nope")


def test_pause_and_resume_from_the_cli(clean_acc: dict[str, str]) -> None:
    env = clean_acc
    paused = cli(env, "pause", "intent", "--reason", "maintenance", "--by", "ops")
    assert paused.returncode == 0, paused.stderr
    assert "family 'intent' paused" in paused.stdout
    status = cli(env, "status", "--json")
    by_family = {s["family"]: s for s in json.loads(status.stdout)}
    assert by_family["intent"]["paused"] is True
    assert "PAUSED" in cli(env, "status").stdout
    assert cli(env, "resume", "intent").returncode == 0
    again = cli(env, "resume", "intent")
    assert again.returncode == 1 and "was not paused" in again.stdout
    unknown = cli(env, "pause", "nope")
    assert unknown.returncode != 0 and "no family 'nope'" in unknown.stderr


@pytest.fixture
def no_pause_left(clean_acc: dict[str, str]) -> Iterator[None]:
    """Whatever this test pauses is resumed at its end, passed or failed: the other tests of
    the schema run their families."""
    yield
    schema = clean_acc["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(clean_acc["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox_paused')


def test_a_paused_family_claims_nothing_for_10_s_while_another_runs_with_a_real_worker(
    clean_acc: dict[str, str], spawn: Callable[..., Any], tmp_path: Path, no_pause_left: None
) -> None:
    """A worker and beat run; the ``custom`` family is paused from the CLI. For 10 s its rows
    are never claimed (no claim token, no start, no handler run) while the ``intent`` family's
    rows, enqueued in the same 10 s, are delivered; resumed, the paused rows are delivered."""
    env, schema = clean_acc, clean_acc["OUTBOX_TEST_SCHEMA"]
    url = env["OUTBOX_TEST_DATABASE_URL"]
    worker = spawn(worker_with_beat("tests.apps.app", tmp_path), env, "worker")

    def ran(command: str) -> int:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        with psycopg.connect(url) as conn:
            found = conn.execute(
                f'SELECT count(*) FROM "{schema}".effects WHERE command = %s', (command,)
            ).fetchone()
        return int(found[0]) if found else 0

    def insert(family: str, command: str, n: int) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                f'INSERT INTO "{schema}".outbox (family, command, payload)'
                " SELECT %s, %s, '{}' FROM generate_series(1, %s)",
                (family, command, n),
            )

    insert("custom", "acc.custom", 1)  # the worker runs both families before the pause
    _wait_for(lambda: ran("acc.custom") == 1, timeout=60)
    paused = cli(env, "pause", "custom", "--reason", "partner API down", "--by", "ops")
    assert paused.returncode == 0, paused.stderr

    insert("custom", "acc.custom", 5)
    waiting = "family = 'custom' AND done_at IS NULL"
    window, polls = time.monotonic() + 10, 0
    while time.monotonic() < window:  # the 10 s the issue asks for
        if polls % 4 == 0:
            insert("intent", "acc.email", 1)  # the other family's rows, all through the 10 s
        assert count_rows(url, schema, f"{waiting} AND claim_token IS NULL") == 5
        assert count_rows(url, schema, f"{waiting} AND started_at IS NULL") == 5
        assert ran("acc.custom") == 1
        polls += 1
        time.sleep(0.5)
    assert count_rows(url, schema, f"{waiting} AND claim_token IS NULL") == 5
    assert ran("acc.custom") == 1
    assert ran("acc.email") >= 3  # the other family's rows went out meanwhile
    status = {s["family"]: s for s in json.loads(cli(env, "status", "--json").stdout)}
    assert status["custom"]["paused"] and status["custom"]["due"] == 5

    resumed = cli(env, "resume", "custom", "--by", "ops")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout
    _wait_for(lambda: ran("acc.custom") == 6, timeout=60)
    assert count_rows(url, schema, waiting) == 0


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
