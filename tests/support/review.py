"""The dispatcher and helpers of the tests written for invariants 11-13 and for the defects an
adversarial review found (issue 12): the ``test_review.py`` module of each folder. A module
imports the fixture ``d`` as ``review_dispatcher``, and gets a Dispatcher of its own on the
session's schema."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Context, Dispatcher, Message
from outbox_dispatch.core.rows import Claimed

Row = dict[str, Any]


@pytest.fixture(scope="module", name="d")
def review_dispatcher(
    database_url: str, redis_url: str, schema: str, key_prefix: str
) -> Iterator[Dispatcher]:
    prefix = f"{key_prefix}inv"
    app = Celery("invariants", broker="memory://", set_as_current=False)
    dispatcher = Dispatcher(
        app,
        database_url=database_url,
        redis_url=redis_url,
        schema=schema,
        key_prefix=prefix,
        listen=False,
    )
    yield dispatcher
    dispatcher.close()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _name(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:6]}"


def _handler(d: Dispatcher, family: str, fn: Callable[[Context, Any], Any], **kw: Any) -> str:
    cmd = f"inv.{uuid.uuid4().hex[:8]}"
    d.handler(cmd, family=family, **kw)(fn)
    return cmd


def _enqueue(d: Dispatcher, database_url: str, msgs: list[Message]) -> list[int]:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return d.enqueue_many(conn, msgs)


def _row(database_url: str, schema: str, row_id: int) -> Row | None:
    with psycopg.connect(database_url) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as c:
        return c.execute(
            f"SELECT *, extract(epoch FROM due_at - now())::float8 AS lease_left "
            f'FROM "{schema}".outbox WHERE id = %s',
            (row_id,),
        ).fetchone()


def _lapse(database_url: str, schema: str, row_id: int) -> None:
    """The row's lease runs out (its holder stopped renewing)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"UPDATE \"{schema}\".outbox SET due_at = now() - interval '1 second' WHERE id = %s",
            (row_id,),
        )


def _claim(d: Dispatcher, family: str) -> list[Claimed]:
    return d.claimer.claim_family(d.families[family]).claimed


def _until_cancelled(
    seconds: float, started: threading.Event | None = None
) -> Callable[[Context, Any], None]:
    """A handler as users write them: works in small steps and stops when told to.
    ``started`` is set when it begins."""

    def handler(ctx: Context, payload: Any) -> None:
        if started is not None:
            started.set()
        deadline = time.monotonic() + seconds
        while not ctx.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)

    return handler
