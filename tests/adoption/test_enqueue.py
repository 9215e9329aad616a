"""Enqueue: the row commits or rolls back with the caller's transaction; bad input writes
nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from outbox_dispatch import (
    Dispatcher,
    InvalidArgument,
    InvalidPayload,
    Message,
    PayloadTooLarge,
    UnknownCommand,
)
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects

from .test_bad_input import MORE_BAD_INPUTS

pytestmark = pytest.mark.usefixtures("clean")


def test_rolled_back_transaction_delivers_nothing(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("SELECT 1")
            dispatcher.enqueue(conn, cmd, {"order": 1})
            raise RuntimeError("business change failed")
    report = dispatcher.drain(timeout=10)
    assert report.delivered == 0
    assert effects.rows(cmd) == []
    assert count_rows(database_url, dispatcher.schema) == 0


def test_committed_row_is_delivered_exactly_once(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {"order": 2}, actor="order:2")
    assert dispatcher.drain(timeout=10).delivered == 1
    assert dispatcher.drain(timeout=10).delivered == 0
    assert effects.calls == [(cmd, row_id, 1, {"order": 2})]
    assert count_rows(database_url, dispatcher.schema) == 0


def test_dedupe_key_returns_the_existing_row(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        first = dispatcher.enqueue(conn, cmd, {"n": 1}, dedupe_key="receipt:42")
        again = dispatcher.enqueue(conn, cmd, {"n": 2}, dedupe_key="receipt:42")
    with psycopg.connect(database_url) as conn, conn.transaction():
        later = dispatcher.enqueue(conn, cmd, {"n": 3}, dedupe_key="receipt:42")
    assert first == again == later
    assert count_rows(database_url, dispatcher.schema) == 1
    dispatcher.drain(timeout=10)
    assert [p for _, _, _, p in effects.calls] == [{"n": 1}]


def test_delay_and_at_hold_the_row_back(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        soon = dispatcher.enqueue(conn, cmd, {"k": "soon"}, delay=timedelta(seconds=0.6))
        dispatcher.enqueue(conn, cmd, {"k": "later"}, at=datetime.now(UTC) + timedelta(hours=1))
    assert dispatcher.drain(timeout=10).delivered == 0
    status = {s.family: s for s in dispatcher.ops.status()}
    assert status["intent"].scheduled == 2
    import time

    time.sleep(0.7)
    assert dispatcher.drain(timeout=10).delivered == 1
    assert effects.rows(cmd) == [soon]


def test_enqueue_many_returns_ids_in_order_and_dedupes(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        existing = dispatcher.enqueue(conn, cmd, {"i": -1}, dedupe_key="dup")
        ids = dispatcher.enqueue_many(
            conn,
            [
                Message(cmd, {"i": 0}),
                Message(cmd, {"i": 1}, dedupe_key="dup"),
                Message(cmd, {"i": 2}, dedupe_key="new"),
                Message(cmd, {"i": 3}, dedupe_key="new"),
                Message(cmd, {"i": 4}, actor="a"),
            ],
        )
    assert ids[1] == existing
    assert ids[2] == ids[3]
    assert ids[0] < ids[2] < ids[4]
    assert count_rows(database_url, dispatcher.schema) == 4


BAD_INPUTS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("unknown command", {"command": "no.such.command"}, UnknownCommand),
    ("empty command", {"command": ""}, UnknownCommand),
    ("payload not JSON", {"payload": {"when": datetime.now(UTC)}}, InvalidPayload),
    ("payload with a set", {"payload": {1, 2}}, InvalidPayload),
    ("payload NaN", {"payload": {"x": math.nan}}, InvalidPayload),
    ("payload non-str key", {"payload": {1: "a"}}, InvalidPayload),
    ("payload NUL", {"payload": "a\x00b"}, InvalidPayload),
    ("payload too large", {"payload": "x" * (256 * 1024)}, PayloadTooLarge),
    ("actor not str", {"actor": 42}, InvalidArgument),
    ("actor empty", {"actor": ""}, InvalidArgument),
    ("dedupe key not str", {"dedupe_key": b"k"}, InvalidArgument),
    ("dedupe key too long", {"dedupe_key": "k" * 513}, InvalidArgument),
    ("delay not timedelta", {"delay": 5}, InvalidArgument),
    ("negative delay", {"delay": timedelta(seconds=-1)}, InvalidArgument),
    ("naive at", {"at": datetime(2030, 1, 1)}, InvalidArgument),
    ("delay and at", {"delay": timedelta(1), "at": datetime.now(UTC)}, InvalidArgument),
]


ALL_BAD_INPUTS = BAD_INPUTS + MORE_BAD_INPUTS


@pytest.mark.parametrize(
    ("what", "change", "error"), ALL_BAD_INPUTS, ids=[b[0] for b in ALL_BAD_INPUTS]
)
def test_bad_input_raises_and_writes_nothing(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    what: str,
    change: dict[str, Any],
    error: type[Exception],
) -> None:
    cmd = commands()
    call: dict[str, Any] = {"command": cmd, "payload": {"ok": True}, **change}
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(error):
            dispatcher.enqueue(conn, **call)
        # the caller's transaction is still usable: the error came before any SQL
        conn.execute("SELECT 1")
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(error):
            dispatcher.enqueue_many(conn, [Message(cmd, {"fine": 1}), Message(**call)])
    assert count_rows(database_url, dispatcher.schema) == 0


def test_enqueue_needs_a_connection_it_can_write_through(
    dispatcher: Dispatcher, commands: Callable[..., str]
) -> None:
    with pytest.raises(InvalidArgument, match=r"cannot write through a builtins\.object: pass"):
        dispatcher.enqueue(object(), commands(), {})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def in_line(dispatcher: Dispatcher) -> str:
    dispatcher.family("in_line", ordered=True)
    dispatcher.declare("o.step", family="in_line")
    return "o.step"


@pytest.mark.parametrize("many", [False, True])
def test_ordered_enqueue_as_the_first_statement_rolls_back_with_the_caller(
    dispatcher: Dispatcher, in_line: str, database_url: str, schema: str, many: bool
) -> None:
    """The actor lock and insert must not run in a transaction of their own: on an idle
    connection that would commit the row before the caller decided."""
    with psycopg.connect(database_url) as conn:
        if many:
            dispatcher.enqueue_many(conn, [Message(in_line, {}, actor="a1")])
        else:
            dispatcher.enqueue(conn, in_line, {}, actor="a1")
        conn.rollback()
        assert count_rows(database_url, schema, "family = 'in_line'") == 0
        dispatcher.enqueue(conn, in_line, {}, actor="a1")
        assert count_rows(database_url, schema, "family = 'in_line'") == 0  # not committed yet
        conn.commit()
    assert count_rows(database_url, schema, "family = 'in_line'") == 1
    with psycopg.connect(database_url, autocommit=True) as conn:
        dispatcher.enqueue(conn, in_line, {}, actor="a2")  # autocommit: the row commits at once
    assert count_rows(database_url, schema, "family = 'in_line'") == 2
