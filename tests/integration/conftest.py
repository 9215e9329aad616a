"""An in-process Celery app, dispatcher and worker on the session's schema and key prefix.

Test handlers record what they ran in ``Effects``; tests register their own commands under
unique names through ``commands``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish

from outbox_dispatch import Backoff, Context, Dispatcher
from tests.conftest import drop_run

from .databases_support import make_dispatcher, shard_urls  # noqa: F401 (several databases)
from .django_support import listening, order_model, orders  # noqa: F401 (for the Django tests)


@dataclass
class Effects:
    """Handler calls seen in this process, thread-safe (the in-process worker uses threads)."""

    calls: list[tuple[str, int, int, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ctx: Context, payload: Any) -> None:
        with self.lock:
            self.calls.append((ctx.command, ctx.row_id, ctx.attempt, payload))

    def rows(self, command: str) -> list[int]:
        with self.lock:
            return [r for c, r, _, _ in self.calls if c == command]

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()


@pytest.fixture(scope="session")
def celery_app(redis_url: str, key_prefix: str) -> Celery:
    app = Celery("outbox_tests", broker=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": key_prefix},
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    return app


@pytest.fixture(scope="session")
def dispatcher(
    celery_app: Celery, database_url: str, redis_url: str, schema: str
) -> Iterator[Dispatcher]:
    # listen=False: these tests claim by hand; the NOTIFY listener has tests of its own
    d = Dispatcher(
        celery_app, database_url=database_url, redis_url=redis_url, schema=schema, listen=False
    )
    d.family("quick", max_attempts=3, lease=5, backoff=Backoff(base=0.05, cap=0.1, jitter=0.0))
    d.family("bulk", max_attempts=3, lease=10, batch=10, backoff=Backoff(0.05, 0.1, 0.0))
    # declared before the session's worker starts, so that it consumes their queues
    d.family("plain")  # nothing set: batches sized per claim
    d.family("cappedbatch", per_actor=2, lease=30)
    yield d
    d.close()


@pytest.fixture(scope="session")
def effects() -> Effects:
    return Effects()


@pytest.fixture
def commands(dispatcher: Dispatcher, effects: Effects) -> Callable[..., str]:
    """Register a fresh command: ``commands(family="quick", fn=...)`` returns its name."""

    def make(family: str = "intent", fn: Callable[[Context, Any], Any] | None = None) -> str:
        name = f"t.{uuid.uuid4().hex[:8]}"

        def handler(ctx: Context, payload: Any) -> None:
            effects.add(ctx, payload)
            if fn is not None:
                fn(ctx, payload)

        dispatcher.handler(name, family=family)(handler)
        return name

    return make


@pytest.fixture(autouse=True)
def clean(database_url: str, schema: str, effects: Effects) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox')
    effects.clear()


@pytest.fixture(scope="session")
def worker(celery_app: Celery, dispatcher: Dispatcher) -> Iterator[object]:
    with start_worker(
        celery_app,
        pool="threads",
        concurrency=4,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=20,
    ) as w:
        yield w


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url) as c:
        yield c


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def record(sender: Any = None, body: Any = None, headers: Any = None, **kw: Any) -> None:
        seen.append({"task": sender, "body": body, "headers": dict(headers or {}), **kw})

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@contextlib.contextmanager
def dispatcher_under(
    options: str, database_url: str, redis_url: str, name: str, **settings: Any
) -> Iterator[tuple[Dispatcher, str]]:
    """A dispatcher (with ``settings``) on a schema and Redis prefix of its own, through a URL
    whose sessions default to ``options`` (as a user's server, role or URL could set them;
    ``""``: the session's URL as it is); yields it and that URL, and drops what it made."""
    url = psycopg.conninfo.make_conninfo(database_url, options=options) if options else database_url
    schema = f"od_test_{uuid.uuid4().hex[:8]}_{name}"
    prefix = f"od{name}{uuid.uuid4().hex[:8]}"
    d = Dispatcher(
        Celery(name, broker="memory://", set_as_current=False),
        database_url=url,
        redis_url=redis_url,
        schema=schema,
        key_prefix=prefix,
        listen=False,
        **settings,
    )
    try:
        yield d, url
    finally:
        d.close()
        drop_run(database_url, schema, redis_url, f"{prefix}:")
