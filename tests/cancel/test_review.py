"""A cancel that a handler saw, and returned after, settles its row as cancelled, not delivered
(invariant 12; issue 12's review), against the real Postgres and Redis."""

from __future__ import annotations

import threading

import psycopg
import pytest

from outbox_dispatch import Dispatcher, Message, Outcome
from tests.support.review import (
    _claim,
    _enqueue,
    _handler,
    _name,
    _row,
    _until_cancelled,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_a_cancel_seen_by_a_handler_that_returns_settles_as_cancelled(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("cancel")
    d.family(fam, lease=10, heartbeat_timeout=1.0)
    started = threading.Event()
    cmd = _handler(d, fam, _until_cancelled(10, started))
    [row_id] = _enqueue(d, database_url, [Message(cmd, {})])
    [c] = _claim(d, fam)

    def cancel() -> None:
        started.wait(5)
        with psycopg.connect(database_url) as conn, conn.transaction():
            d.cancel(conn, row_id, reason="not needed")

    threading.Thread(target=cancel).start()
    assert d.delivery.deliver(c.id, c.token, family_hint=fam).outcome is Outcome.CANCELLED
    row = _row(database_url, schema, row_id)
    assert row is not None and row["cancelled_at"] is not None
