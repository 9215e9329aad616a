"""Row helpers of settle/test_settle.py and delivery/test_delivery.py: read a row, enqueue one,
claim the one due row of a family."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from outbox_dispatch import Dispatcher


def _row(database_url: str, schema: str, row_id: int) -> dict[str, Any]:
    with (
        psycopg.connect(database_url) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        found = cur.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert found is not None
    return found


def _enqueue(dispatcher: Dispatcher, database_url: str, cmd: str, payload: Any = None) -> int:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return dispatcher.enqueue(conn, cmd, payload or {})


def _claim_one(dispatcher: Dispatcher, family: str = "intent") -> tuple[int, uuid.UUID]:
    result = dispatcher.claimer.claim_family(dispatcher.families[family])
    assert len(result.claimed) == 1
    c = result.claimed[0]
    return c.id, c.token
