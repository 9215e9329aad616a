"""The local hand-off (handoff.py) against a real in-process worker: the messages its own commit
listener claims go to its idle pool processes without the broker, the rest through the broker,
and what the worker still holds when its consumer stops goes to the broker for another."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from outbox_dispatch import Context, Dispatcher, Message
from outbox_dispatch.migrations import migrate
from outbox_dispatch.publisher import Wire
from tests.conftest import count_rows


class Seen:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.lock = threading.Lock()
        self.release = threading.Event()

    def add(self, row_id: int) -> None:
        with self.lock:
            self.rows.append(row_id)


@pytest.fixture(scope="module")
def listening(
    database_url: str, redis_url: str, schema: str, key_prefix: str
) -> Iterator[tuple[Dispatcher, Seen, list[int]]]:
    """A listening dispatcher on a schema and key prefix of its own, with its own worker
    (threads, two of them); ``sent`` counts the messages that went to the broker."""
    own_schema = f"{schema}_ho"
    migrate(database_url, own_schema)
    prefix = f"{key_prefix}ho{uuid.uuid4().hex[:6]}:"
    app = Celery("handoff", broker=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": prefix},
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    d = Dispatcher(
        app,
        database_url=database_url,
        redis_url=redis_url,
        schema=own_schema,
        key_prefix=prefix.rstrip(":"),
    )
    d.family("ho", batch=1)
    seen = Seen()

    @d.handler("ho.run", family="ho")
    def run(ctx: Context, payload: Any) -> None:
        seen.add(ctx.row_id)
        if payload.get("hold"):
            assert seen.release.wait(10)

    sent: list[int] = []
    send = d.publisher.send

    def counted(queue: str, wires: Any) -> None:  # observed, not replaced
        sent.append(len(wires))
        send(queue, wires)

    d.publisher.send = counted  # type: ignore[method-assign]
    try:
        with start_worker(
            app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"
        ):
            assert d.handoff is not None
            deadline = time.monotonic() + 10
            while d.handoff._wake is None:  # the consumer step attached it
                assert time.monotonic() < deadline, "the hand-off was never attached"
                time.sleep(0.02)
            yield d, seen, sent
    finally:
        d.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{own_schema}" CASCADE')
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


@pytest.fixture
def handing(
    listening: tuple[Dispatcher, Seen, list[int]],
) -> Iterator[tuple[Dispatcher, Seen, list[int]]]:
    _d, seen, sent = listening
    seen.rows.clear()
    sent.clear()
    seen.release.clear()
    yield listening
    seen.release.set()  # nothing holds a thread past its test


def _wait_for(check: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_committed_row_goes_straight_to_an_idle_pool_process(
    handing: tuple[Dispatcher, Seen, list[int]], database_url: str
) -> None:
    d, seen, sent = handing
    assert d.handoff is not None
    before = d.handoff.handed
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = d.enqueue(conn, "ho.run", {})
    _wait_for(lambda: row_id in seen.rows, "the row was never delivered")
    _wait_for(lambda: count_rows(database_url, d.schema, f"id = {row_id}") == 0, "not settled")
    assert d.handoff.handed == before + 1
    assert sent == []  # nothing went through the broker


def test_a_backlog_beyond_the_idle_processes_goes_through_the_broker(
    handing: tuple[Dispatcher, Seen, list[int]], database_url: str
) -> None:
    """Two idle processes take two messages; the other eight go to the broker, where every
    worker can take them (here the same one), and each row runs once."""
    d, seen, sent = handing
    assert d.handoff is not None
    before = d.handoff.handed
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = d.enqueue_many(conn, [Message("ho.run", {"n": i}) for i in range(10)])
    _wait_for(lambda: set(ids) <= set(seen.rows), "rows were never delivered")
    assert sorted(r for r in seen.rows if r in ids) == sorted(ids)  # each once
    assert d.handoff.handed - before == 2  # its prefetch: one per process
    assert sum(sent) == 8


def test_what_the_worker_holds_when_its_consumer_stops_goes_to_the_broker(
    handing: tuple[Dispatcher, Seen, list[int]], database_url: str
) -> None:
    """A message given to the worker that has not started when its consumer stops (a warm
    shutdown, a lost broker connection) is published for another worker, as kombu gives
    back a prefetched broker message; one that is running is left to finish."""
    d, seen, _sent = handing
    handoff = d.handoff
    assert handoff is not None
    with psycopg.connect(database_url) as conn, conn.transaction():
        held = d.enqueue(conn, "ho.run", {"hold": True})
    _wait_for(lambda: held in seen.rows, "the holding row never started")
    wire = Wire("t-" + uuid.uuid4().hex, "[]", {}, {})
    with handoff._lock:  # taken, not yet given to Celery
        handoff._pending.append((d.queue_name("ho"), wire))
    published: list[tuple[str, list[str]]] = []
    real = handoff.republish
    handoff.republish = lambda queue, wires: published.append((queue, [w.task_id for w in wires]))
    try:
        handoff.detach()  # what the consumer step does when the consumer stops
        assert published == [(d.queue_name("ho"), [wire.task_id])]  # not the running one
        assert handoff.take(d.queue_name("ho"), [wire]) == 0  # detached: the broker from now
    finally:
        handoff.republish = real
        seen.release.set()
