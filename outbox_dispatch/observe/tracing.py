"""OpenTelemetry: a delivery joins the trace of the request that enqueued it.

Enqueue stores the current context (W3C ``traceparent``, through the configured propagator) in
the row; the worker runs the handler inside a consumer span whose parent is that context, so a
trace shows the request, its outbox row and the handler's own spans as one tree, however long
the row waited. Only the API is a dependency: without an SDK configured, spans are no-ops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from outbox_dispatch.core.rows import Started

_tracer = trace.get_tracer("outbox_dispatch")

# outcomes that end a delivery span in error
_FAILED = {"retried", "parked", "lost"}


def current_context_json() -> str | None:
    """The caller's trace context as JSON for the row, or None outside any trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return json.dumps(carrier) if carrier else None


def attributes(started: Started) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "messaging.system": "outbox_dispatch",
        "messaging.operation": "process",
        "outbox.row_id": started.id,
        "outbox.family": started.family,
        "outbox.command": started.command,
        "outbox.attempt": started.attempts,
        "outbox.maybe_applied": started.maybe_applied,
    }
    if started.actor is not None:
        attrs["outbox.actor"] = started.actor
    return attrs


def _recording() -> bool:
    """Whether an SDK is configured (read per call: the app may set one after import)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@contextmanager
def delivery_span(started: Started) -> Iterator[trace.Span]:
    """The span a handler runs in: a child of the enqueuing span when the row carries one.
    Without an SDK nothing would record it: no span is built (a row's cost, not a trace's)."""
    if not _recording():
        yield trace.INVALID_SPAN
        return
    parent = propagate.extract(started.trace_context) if started.trace_context else None
    with _tracer.start_as_current_span(
        f"outbox deliver {started.command}",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attributes(started),
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield span


def finish(span: trace.Span, outcome: str, detail: str = "") -> None:
    span.set_attribute("outbox.outcome", outcome)
    if outcome in _FAILED:
        span.set_status(Status(StatusCode.ERROR, detail[:500] or outcome))
