"""Without an OpenTelemetry SDK, a delivery builds no span; with one, it does."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from uuid import uuid4
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from outbox_dispatch.observe import tracing
from outbox_dispatch.core.rows import Started

row = Started(1, uuid4(), "intent", "c", None, {}, 1, False, None, False, 0.0, None)
tracer, tracing._tracer = tracing._tracer, None  # building a span would fail here
with tracing.delivery_span(row) as span:
    assert span is trace.INVALID_SPAN, span
tracing._tracer = tracer
trace.set_tracer_provider(TracerProvider())
with tracing.delivery_span(row) as span:
    assert span.is_recording(), span
print("ok")
"""


def test_spans_are_built_only_once_an_sdk_is_configured() -> None:
    # a process of its own: OpenTelemetry takes one global provider per process
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
