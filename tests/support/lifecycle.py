"""The dispatcher and helpers of the in-process life-cycle tests (settle/test_lifecycle.py,
cancel/test_cancel.py, delivery/test_heartbeats.py, operations/test_cron.py). A module
imports the fixture ``life`` as ``life_dispatcher``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Backoff, Dispatcher


@pytest.fixture(scope="module", name="life")
def life_dispatcher(database_url: str, schema: str) -> Iterator[Dispatcher]:
    app = Celery("life_tests", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url=database_url, schema=schema)
    d.family(
        "short", lease=1.0, heartbeat_timeout=1.0, max_attempts=3, backoff=Backoff(0.01, 0.01, 0)
    )
    d.family("kept", lease=30, retention=3600)
    d.family("gone", lease=30, retention=0)
    d.family("fragile", lease=30, max_attempts=5, on_lost="park")
    d.family("line", lease=30, ordered=True)
    yield d
    d.close()


def _name() -> str:
    return f"l.{uuid.uuid4().hex[:8]}"


def _one(d: Dispatcher, url: str, cmd: str, payload: Any = None, **kw: Any) -> int:
    with psycopg.connect(url) as conn, conn.transaction():
        return d.enqueue(conn, cmd, payload if payload is not None else {}, **kw)


def _row(url: str, schema: str, row_id: int) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        found = cur.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert found is not None
    return found


def _effects_table(url: str, schema: str) -> str:
    name = f'"{schema}".effects_{uuid.uuid4().hex[:6]}'
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (row_id bigint, note text)")
    return name
