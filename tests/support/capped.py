"""The dispatcher of the in-process caps and order tests (caps/test_caps.py,
order/test_ordered.py), on a Redis database of its own that is flushed after each module,
with a capped, an ordered and a passing family. A test module imports the fixtures
``caps_url``, ``capped`` and ``record`` by their function names (``capped_fixture``...)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Backoff, Context, Dispatcher, Message

CAPS_REDIS_DB = 13  # flushed by these tests: nothing else may live there


@pytest.fixture(scope="module", name="caps_url")
def caps_url_fixture(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{CAPS_REDIS_DB}"


@pytest.fixture(scope="module", name="capped")
def capped_fixture(
    database_url: str, schema: str, caps_url: str, run_id: str
) -> Iterator[Dispatcher]:
    app = Celery("caps_tests", broker=caps_url, set_as_current=False)
    app.conf.update(task_ignore_result=True)
    d = Dispatcher(
        app, database_url=database_url, redis_url=caps_url, schema=schema, key_prefix=f"t{run_id}"
    )
    d.family("capped", per_actor=2, lease=30, max_attempts=3, backoff=Backoff(0.01, 0.01, 0))
    d.family("lined", ordered=True, lease=30, max_attempts=2, backoff=Backoff(0.01, 0.01, 0))
    d.family("passing", ordered=True, lease=30, max_attempts=1, parked_blocks=False)
    yield d
    d.close()
    redis.Redis.from_url(caps_url).flushdb()


@pytest.fixture(name="record")
def record_fixture(capped: Dispatcher) -> Callable[..., str]:
    seen: list[tuple[str, Any]] = []

    def make(family: str, fn: Callable[[Context, Any], Any] | None = None, **kw: Any) -> str:
        name = f"c.{uuid.uuid4().hex[:8]}"

        def handler(ctx: Context, payload: Any) -> None:
            seen.append((ctx.actor or "", payload))
            if fn:
                fn(ctx, payload)

        capped.handler(name, family=family, **kw)(handler)
        return name

    make.seen = seen  # type: ignore[attr-defined]
    return make


def _enqueue(d: Dispatcher, database_url: str, msgs: list[Message]) -> list[int]:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return d.enqueue_many(conn, msgs)
