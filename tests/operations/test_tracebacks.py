"""A failed attempt keeps the handler's traceback beside its error: the row, the operator's
``parked show``, the page and the parked row's ERROR line all show where the handler failed,
cut to its last 8 KB when it is long."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher, PermanentFailure
from outbox_dispatch.worker.messages import MAX_TRACEBACK, describe_traceback
from tests.fixtures.processes import cli

pytestmark = pytest.mark.usefixtures("clean")


def _lookup_customer(payload: Any) -> Any:
    return payload["customer"]  # KeyError deep in the handler's own code


def _raise_long() -> None:
    _raise_long_inner()


def _raise_long_inner() -> None:
    raise ValueError("x" * 20_000)


def test_a_failed_attempt_keeps_the_handlers_traceback(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    conn: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dispatcher.family("tb", max_attempts=1)

    def handler(ctx: Context, payload: Any) -> None:
        _lookup_customer(payload)

    def refuses(ctx: Context, payload: Any) -> None:
        raise PermanentFailure("the customer is gone")

    deep, permanent = commands(family="tb", fn=handler), commands(family="tb", fn=refuses)
    with conn.transaction():
        deep_id = dispatcher.enqueue(conn, deep, {"order": 7})
        permanent_id = dispatcher.enqueue(conn, permanent, {"order": 8})
    with caplog.at_level(logging.ERROR, logger="outbox_dispatch"):
        dispatcher.drain(timeout=10)
    row = dispatcher.ops.row(deep_id)
    assert row is not None and row["parked_at"] is not None
    assert row["last_error"] == "KeyError: 'customer'"
    assert "in _lookup_customer" in row["last_traceback"]
    assert 'return payload["customer"]' in row["last_traceback"]
    other = dispatcher.ops.row(permanent_id)
    assert other is not None and "in refuses" in other["last_traceback"]
    assert "PermanentFailure: the customer is gone" in other["last_traceback"]
    line = next(r for r in caplog.records if f"parked show {deep_id}" in r.getMessage())
    assert "in _lookup_customer" in line.getMessage()


def test_a_long_traceback_keeps_the_handlers_frames_within_its_bound() -> None:
    try:
        _raise_long()
    except ValueError as exc:
        text = describe_traceback(exc)
    assert len(text) <= MAX_TRACEBACK
    assert "in _raise_long_inner" in text and "in _raise_long\n" in text
    assert text.startswith("Traceback (most recent call last):")


def test_parked_show_prints_the_traceback(clean_acc: dict[str, str]) -> None:
    env, schema = clean_acc, clean_acc["OUTBOX_TEST_SCHEMA"]
    trace = 'Traceback (most recent call last):\n  File "shop.py", line 3, in _lookup_customer\n'
    trace += "KeyError: 'customer'"
    sql = (
        f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
        " last_error, last_traceback) VALUES ('intent', 'acc.x', %s, now(), 1, %s, %s)"
        " RETURNING id"
    )
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        found = conn.execute(sql, ('{"order": 8}', "KeyError: 'customer'", trace)).fetchone()
    assert found is not None
    row_id = str(found[0])
    shown = cli(env, "parked", "show", row_id)
    assert shown.returncode == 0, shown.stderr
    assert "last_error: KeyError: 'customer'" in shown.stdout
    assert "in _lookup_customer" in shown.stdout
    as_json = cli(env, "parked", "show", row_id, "--json")
    assert "in _lookup_customer" in json.loads(as_json.stdout)["last_traceback"]
    missing = cli(env, "parked", "show", "999999999")
    assert missing.returncode == 1 and "no row 999999999" in missing.stdout
