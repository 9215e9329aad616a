"""Cancellation in one process: pending rows by id, dedupe key and actor; a running handler
told within one heartbeat (a transactional one's writes rolled back); a row cancelled while
its message travels never runs; cancelling an ordered head lets the next row run."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher, InvalidArgument, Outcome
from tests.support.lifecycle import (
    _effects_table,
    _name,
    _one,
    _row,
    life_dispatcher,  # noqa: F401 (the fixture life)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_cancel_pending_rows_by_id_dedupe_key_and_actor(
    life: Dispatcher, database_url: str
) -> None:
    cmd, other = _name(), _name()
    ran: list[int] = []
    life.handler(cmd, family="kept")(lambda ctx, p: ran.append(ctx.row_id))
    life.handler(other, family="kept")(lambda ctx, p: ran.append(ctx.row_id))
    a = _one(life, database_url, cmd)
    b = _one(life, database_url, cmd, dedupe_key="order:7")
    c = _one(life, database_url, cmd, actor="user:1")
    d = _one(life, database_url, cmd, actor="user:1")
    e = _one(life, database_url, other, actor="user:1")
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, a, reason="customer left", by="ops").cancelled == [a]
        assert life.cancel(conn, dedupe_key="order:7").cancelled == [b]
        assert life.cancel(conn, actor="user:1", command=cmd).cancelled == [c, d]
        with pytest.raises(InvalidArgument):
            life.cancel(conn)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(psycopg.errors.Error), conn.transaction():  # rolled back: no cancel
            life.cancel(conn, e)
            conn.execute("SELECT 1/0")
    life.drain(timeout=5)
    assert ran == [e]
    row = _row(database_url, life.schema, a)
    assert row["cancelled_at"] is not None
    assert (row["cancel_reason"], row["cancelled_by"]) == ("customer left", "ops")
    status = {s.family: s for s in life.ops.status()}["kept"]
    assert status.cancelled == 4


def test_cancel_reaches_a_running_handler_within_one_heartbeat(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    stopped: list[float] = []
    started = threading.Event()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: every ~0.33 s
    def loop(ctx: Context, payload: Any) -> None:
        started.set()
        deadline = time.monotonic() + 10
        while not ctx.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(time.monotonic())

    row_id = _one(life, database_url, cmd)
    reports: list[Any] = []
    t = threading.Thread(target=lambda: reports.append(life.drain(timeout=15)))
    t.start()
    assert started.wait(5)
    with psycopg.connect(database_url) as conn, conn.transaction():
        asked = life.cancel(conn, row_id, reason="stop it")
    cancelled_at = time.monotonic()
    assert asked.requested == [row_id] and asked.cancelled == []
    t.join(15)
    assert reports[0].count(Outcome.CANCELLED) == 1
    assert stopped and stopped[0] - cancelled_at < 1.0 / 3 + 0.35  # one heartbeat + a tick
    row = _row(database_url, life.schema, row_id)
    assert row["cancelled_at"] is not None and row["cancel_reason"] == "stop it"
    assert row["claim_token"] is None


def test_row_cancelled_while_its_message_travels_never_runs(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    ran: list[int] = []
    life.handler(cmd, family="kept")(lambda ctx, p: ran.append(1))
    row_id = _one(life, database_url, cmd)
    claimed = life.claimer.claim_family(life.families["kept"]).claimed[0]
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, row_id).requested == [row_id]  # claimed: the holder settles
    assert life.delivery.deliver(row_id, claimed.token).outcome is Outcome.CANCELLED
    assert ran == []
    assert _row(database_url, life.schema, row_id)["cancelled_at"] is not None


def test_cancelling_an_ordered_head_lets_the_next_row_run(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    ran: list[int] = []
    life.handler(cmd, family="line")(lambda ctx, p: ran.append(p["n"]))
    first = _one(life, database_url, cmd, {"n": 0}, actor="L", delay=timedelta(hours=1))
    _one(life, database_url, cmd, {"n": 1}, actor="L")
    life.drain(timeout=5)
    assert ran == []  # the delayed head holds the line
    with psycopg.connect(database_url) as conn, conn.transaction():
        life.cancel(conn, first)
    life.drain(timeout=5)
    assert ran == [1]


def test_transactional_handler_cancelled_mid_run_rolls_its_writes_back(
    life: Dispatcher, database_url: str
) -> None:
    table = _effects_table(database_url, life.schema)
    cmd = _name()
    go = threading.Event()

    @life.handler(cmd, family="kept", transactional=True)
    def write(ctx: Context, payload: Any) -> None:
        ctx.conn.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (ctx.row_id,))
        go.set()
        time.sleep(0.5)  # the cancel arrives now; the row is locked, so it is a request

    row_id = _one(life, database_url, cmd)
    t = threading.Thread(target=lambda: life.drain(timeout=10))
    t.start()
    assert go.wait(5)
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, row_id).requested == [row_id]
    t.join(10)
    with psycopg.connect(database_url) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    assert _row(database_url, life.schema, row_id)["cancelled_at"] is not None
