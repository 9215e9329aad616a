"""Invariant 12 under Celery's own time limit, in a real prefork worker: nothing settles as
delivered unless its handler returned on its own. A handler of a family with ``time_limit=1``
sleeps past the limit, catches the SoftTimeLimitExceeded that Celery raises inside it and
returns at once: its row is retried (maybe_applied) with the time limit as its last error, and
never deleted as delivered, whichever of the two timers (Celery's, the outbox's) ran first.

This module is also the worker's app (``celery -A tests.delivery.test_time_limits:app``):
with OUTBOX_TEST_TIME_LIMITS_WORKER set it builds the app and the handler below."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from outbox_dispatch import Backoff, Context, Dispatcher, Message
from outbox_dispatch.store.migrations import migrate
from tests.conftest import drop_run
from tests.faults.test_fault_processes import _wait
from tests.faults.test_lifecycle_processes import _query
from tests.fixtures.processes import worker_with_beat

ROWS = 3
TIME_LIMIT = 1
# family -> rows per message: pinned to one, and sized per claim (the default)
FAMILIES: dict[str, int | None] = {"tl_one": 1, "tl_sized": None}
# a retried row is due again only in an hour: it sits retried for the assertions to read
BACKOFF = Backoff(base=3600.0, cap=3600.0, jitter=0.0)


def _declare(d: Dispatcher) -> None:
    """The families and commands, as both the worker and the producer declare them."""
    for name, batch in FAMILIES.items():
        d.family(name, time_limit=TIME_LIMIT, batch=batch, max_attempts=3, backoff=BACKOFF)
        d.declare(f"{name}.sleep", family=name)


def _worker_app() -> tuple[Celery, Dispatcher]:
    # imported here: envapp reads the schema from the environment when first imported, which
    # must be the worker's, not the test session's at collection
    from tests.apps.envapp import SCHEMA, make_app

    worker_app, dispatcher = make_app("time_limits_acceptance", claim_interval=0.25)
    _declare(dispatcher)

    def sleep_past_the_limit(ctx: Context, payload: Any) -> None:
        with dispatcher.store.connection() as conn:
            conn.execute(
                f'INSERT INTO "{SCHEMA}".runs (row_id, attempt, maybe_applied, pid)'
                " VALUES (%s, %s, %s, %s)",
                (ctx.row_id, ctx.attempt, ctx.maybe_applied, os.getpid()),
            )
        try:
            time.sleep(payload["sleep"])
        except SoftTimeLimitExceeded:
            return  # at once, as a handler that cleans up quickly would: it did not finish

    for name in FAMILIES:
        dispatcher.handler(f"{name}.sleep", family=name)(sleep_past_the_limit)
    return worker_app, dispatcher


if os.environ.get("OUTBOX_TEST_TIME_LIMITS_WORKER"):
    app, dispatcher = _worker_app()


@pytest.fixture
def env(acc_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_tl_{run_id}_{random.randrange(10**6)}"
    e = {
        **acc_env,
        "OUTBOX_TEST_SCHEMA": schema,
        "OUTBOX_TEST_KEY_PREFIX": f"{schema}:",
        "OUTBOX_TEST_TIME_LIMITS_WORKER": "1",
    }
    url = e["OUTBOX_TEST_DATABASE_URL"]
    migrate(url, schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".runs (row_id bigint, attempt int, maybe_applied bool,'
            " pid int, at timestamptz DEFAULT clock_timestamp())"
        )
    yield e
    drop_run(url, schema, e["OUTBOX_TEST_REDIS_URL"], f"{schema}:")


def _enqueue(env: dict[str, str], msgs: list[Message]) -> list[int]:
    producer = Celery("producer", broker="memory://", set_as_current=False)
    d = Dispatcher(
        producer, database_url=env["OUTBOX_TEST_DATABASE_URL"], schema=env["OUTBOX_TEST_SCHEMA"]
    )
    _declare(d)
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = d.enqueue_many(conn, msgs)
    d.close()
    return ids


def _slow_starts(env: dict[str, str], seconds: float) -> None:
    """Every start of an attempt (the statement that sets started_at) takes ``seconds``
    longer, as over a slower network or on a busy server: Celery's clock for the message runs
    meanwhile."""
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            f'CREATE FUNCTION "{schema}".slow_start() RETURNS trigger LANGUAGE plpgsql'
            f" AS $$ BEGIN PERFORM pg_sleep({seconds:g}); RETURN NEW; END $$"
        )
        conn.execute(
            f'CREATE TRIGGER slow_start BEFORE UPDATE OF started_at ON "{schema}".outbox'
            " FOR EACH ROW WHEN (OLD.started_at IS NULL AND NEW.started_at IS NOT NULL)"
            f' EXECUTE FUNCTION "{schema}".slow_start()'
        )


@pytest.mark.parametrize(
    ("family", "slow_start"),
    [("tl_one", 0.0), ("tl_sized", 0.0), ("tl_one", 0.3)],
    ids=["batch=1", "batch=default", "batch=1-slow-start"],
)
def test_a_handler_that_returns_after_its_soft_time_limit_is_never_settled_as_delivered(
    env: dict[str, str],
    spawn: Callable[..., Popen[bytes]],
    tmp_path: Path,
    family: str,
    slow_start: float,
) -> None:
    """Three rows, one per message (three rows are too few for the default sizing to pack),
    each in a pool process of its own. Celery's soft limit is timed from the moment a pool
    process takes the message; the outbox must not count from a later moment (after its start
    statement), or a handler that returns as soon as the limit interrupts it is settled as
    delivered. ``slow_start`` widens that gap the way a slower database round trip does."""
    if slow_start:
        _slow_starts(env, slow_start)
    ids = _enqueue(env, [Message(f"{family}.sleep", {"sleep": 30}) for _ in range(ROWS)])
    worker = spawn(
        worker_with_beat(
            "tests.delivery.test_time_limits:app",
            tmp_path,
            "-P",
            "prefork",
            "-n",
            "time-limits@%h",
            concurrency=ROWS,
        ),
        env,
        "worker",
    )

    def settled() -> bool:
        """Every row ran, and none is claimed any more: delivered (gone), retried or parked."""
        ran = {r for (r,) in _query(env, "SELECT DISTINCT row_id FROM S.runs")}
        claimed = _query(
            env, "SELECT id FROM S.outbox WHERE id = ANY(%s) AND claim_token IS NOT NULL", ids
        )
        return ran >= set(ids) and not claimed

    # the soft limit comes 1 s into each attempt; an attempt that ran on to the hard limit
    # (2 s) would sit claimed for its 30 s heartbeat timeout, and fail this wait
    _wait(settled, 25, "every row to run and settle", worker)

    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert log.count(f"Soft time limit ({TIME_LIMIT}") == ROWS, "Celery's soft limit did not fire"
    starts = _query(env, "SELECT row_id, attempt, maybe_applied FROM S.runs ORDER BY row_id")
    assert starts == [(i, 1, False) for i in ids]

    rows = {
        int(i): (attempts, maybe_applied, parked_at, last_error)
        for i, attempts, maybe_applied, parked_at, last_error in _query(
            env,
            "SELECT id, attempts, maybe_applied, parked_at, last_error FROM S.outbox"
            " WHERE id = ANY(%s)",
            ids,
        )
    }
    delivered = [i for i in ids if i not in rows]
    assert not delivered, (
        f"rows {delivered} of {ids} were settled as delivered (deleted), although each "
        f"handler returned only after Celery's soft time limit of {TIME_LIMIT} s interrupted it"
    )
    for i in ids:
        attempts, maybe_applied, parked_at, last_error = rows[i]
        assert (attempts, maybe_applied, parked_at) == (1, True, None), (i, rows[i])
        assert f"time_limit of {TIME_LIMIT} s" in str(last_error), (i, last_error)
    assert worker.poll() is None
