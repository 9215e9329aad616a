"""Prometheus metrics scraped over HTTP, and an OpenTelemetry trace joined across enqueue and
delivery, against the real Postgres, Redis and an in-process worker."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from outbox_dispatch import Context, Dispatcher, Message, PermanentFailure
from outbox_dispatch.observe import metrics
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_for(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def server(dispatcher: Dispatcher) -> Iterator[int]:
    port = free_port()
    srv = metrics.serve(dispatcher, port, "127.0.0.1", cache_seconds=0)  # every scrape reads
    yield port
    srv.shutdown()
    srv.server_close()


def test_metrics_endpoint_reports_gauges_counters_and_latency(
    dispatcher: Dispatcher,
    worker: object,
    commands: Callable[..., str],
    database_url: str,
    schema: str,
    server: int,
) -> None:
    ok = commands(family="quick")

    def refuse(ctx: Context, payload: Any) -> None:
        raise PermanentFailure("payload fails the handler's schema")

    bad = commands(family="quick", fn=refuse)
    before = scrape(server)
    with psycopg.connect(database_url) as conn, conn.transaction():
        for i in range(5):
            dispatcher.enqueue(conn, ok, {"n": i})
        dispatcher.enqueue(conn, bad, {"n": "x"})
        dispatcher.enqueue(conn, ok, {"later": True}, delay=timedelta(hours=1))
    dispatcher.runtime.claim_and_publish(["quick"])
    wait_for(lambda: count_rows(database_url, schema, "claim_token IS NOT NULL") == 0)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"database": "default", **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("outbox_deliveries_total", family="quick", outcome="delivered") == 5
    assert delta("outbox_deliveries_total", family="quick", outcome="parked") == 1
    assert delta("outbox_claimed_total", family="quick") == 6
    assert delta("outbox_commit_to_start_seconds_count", family="quick") == 6
    assert delta("outbox_handler_duration_seconds_count", family="quick", command=ok) == 5
    assert delta("outbox_claim_duration_seconds_count", family="quick") >= 1
    # gauges read from Postgres and the broker at scrape time
    assert after[("outbox_up", (("database", "default"),))] == 1
    at = (("database", "default"), ("family", "quick"))
    assert after[("outbox_parked", at)] == 1
    assert after[("outbox_scheduled", at)] == 1
    assert after[("outbox_due", at)] == 0
    assert after[("outbox_queue_length", (("family", "quick"),))] == 0
    intent = (("database", "default"), ("family", "intent"))
    assert ("outbox_oldest_due_age_seconds", intent) in after


def test_queue_length_counts_messages_nobody_consumed(
    database_url: str, redis_url: str, schema: str, key_prefix: str, conn: psycopg.Connection[Any]
) -> None:
    """A producer whose queues no worker consumes: its messages wait in the broker."""
    app = Celery("qlen", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": key_prefix}
    d = Dispatcher(
        app,
        database_url=database_url,
        schema=schema,
        queue_prefix="qlen",
        listen=False,
        consumers=1,
    )
    d.family("reports", batch=10)  # sized per claim: 25 rows over 4 messages of one consumer
    d.declare("q.report", family="reports")
    try:
        with conn.transaction():
            d.enqueue_many(conn, [Message("q.report", {"n": i}) for i in range(25)])
        assert d.runtime.queue_lengths()["reports"] == 0
        d.runtime.claim_and_publish(["reports"])
        assert d.runtime.queue_lengths()["reports"] == 4  # 7, 7, 7 and 4 rows
    finally:
        d.close()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: OpenTelemetry refuses a second
    return exporter


def test_delivery_span_is_a_child_of_the_enqueuing_span(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    conn: psycopg.Connection[Any],
    spans: InMemorySpanExporter,
) -> None:
    inside: list[Any] = []
    name = commands(family="quick", fn=lambda ctx, p: inside.append(trace.get_current_span()))
    tracer = trace.get_tracer("shop")
    with tracer.start_as_current_span("POST /orders") as request, conn.transaction():
        row_id = dispatcher.enqueue(conn, name, {"order": 7}, actor="customer-9")
    untraced = commands(family="quick")
    with conn.transaction():
        dispatcher.enqueue(conn, untraced, {})
    assert dispatcher.drain().delivered == 2

    finished = {s.name: s for s in spans.get_finished_spans()}
    span = finished[f"outbox deliver {name}"]
    assert span.context.trace_id == request.get_span_context().trace_id
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id
    assert span.kind == trace.SpanKind.CONSUMER
    attrs = dict(span.attributes or {})
    assert attrs["outbox.row_id"] == row_id
    assert attrs["outbox.family"] == "quick"
    assert attrs["outbox.command"] == name
    assert attrs["outbox.actor"] == "customer-9"
    assert attrs["outbox.attempt"] == 1
    assert attrs["outbox.outcome"] == "delivered"
    # the handler's own spans nest under the delivery span
    assert inside[0].get_span_context().span_id == span.context.span_id
    # a row enqueued outside any trace starts its own
    root = finished[f"outbox deliver {untraced}"]
    assert root.parent is None


def test_every_row_of_a_batch_joins_the_trace_it_was_enqueued_in(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    conn: psycopg.Connection[Any],
    spans: InMemorySpanExporter,
) -> None:
    name = commands(family="quick")
    tracer = trace.get_tracer("shop")
    with tracer.start_as_current_span("POST /import") as request, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(name, {"n": i}) for i in range(3)])
    with conn.transaction():
        untraced = dispatcher.enqueue_many(conn, [Message(name, {"n": 3})])
    assert dispatcher.drain().delivered == 4

    by_row = {
        dict(s.attributes or {})["outbox.row_id"]: s
        for s in spans.get_finished_spans()
        if s.name == f"outbox deliver {name}"
    }
    for row_id in ids:
        parent = by_row[row_id].parent
        assert parent is not None and parent.span_id == request.get_span_context().span_id
    assert by_row[untraced[0]].parent is None  # the trace read for a batch is not kept after it


def test_failed_attempt_marks_its_span_in_error(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    conn: psycopg.Connection[Any],
    spans: InMemorySpanExporter,
) -> None:
    def boom(ctx: Context, payload: Any) -> None:
        raise RuntimeError("upstream said 503")

    name = commands(family="quick", fn=boom)
    with conn.transaction():
        dispatcher.enqueue(conn, name, {})
    deadline = time.monotonic() + 15
    while not [s for s in spans.get_finished_spans() if s.name.endswith(name)][2:]:
        assert time.monotonic() < deadline, "three attempts did not run"
        dispatcher.drain(timeout=10)  # quick retries after 0.05 s, three attempts in all
        time.sleep(0.05)
    failed = [s for s in spans.get_finished_spans() if s.name == f"outbox deliver {name}"]
    outcomes = [
        (dict(s.attributes or {})["outbox.attempt"], dict(s.attributes or {})["outbox.outcome"])
        for s in failed
    ]
    assert outcomes == [(1, "retried"), (2, "retried"), (3, "parked")]
    for s in failed:
        assert s.status.status_code == trace.StatusCode.ERROR
        assert "503" in (s.status.description or "")


def test_stale_messages_waiting_in_the_queue_are_not_multiplied(
    database_url: str, redis_url: str, schema: str, key_prefix: str, conn: psycopg.Connection[Any]
) -> None:
    """No worker consumes: leases run out while the messages wait. A claimer counting only live
    leases would re-claim and republish the rows each pass, without bound; the broker's queue
    length caps what it adds."""
    app = Celery("backlog", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": key_prefix}
    d = Dispatcher(app, database_url=database_url, schema=schema, queue_prefix="blog", listen=False)
    d.family("hooks", max_in_flight=10, lease=1, batch=1)
    d.declare("b.hook", family="hooks")
    try:
        with conn.transaction():
            d.enqueue_many(conn, [Message("b.hook", {"n": i}) for i in range(50)])
        assert d.runtime.claim_and_publish(["hooks"]).total == 10
        time.sleep(1.2)  # every lease ran out; the 10 messages are still queued
        assert d.runtime.claim_and_publish(["hooks"]).total == 0
        assert d.runtime.queue_lengths()["hooks"] == 10
    finally:
        d.close()
