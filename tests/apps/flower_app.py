"""The worker app of the Flower test: one command per outcome a delivery can have, so that
Flower's view of each can be read back (``celery -A tests.apps.flower_app worker -E``)."""

from __future__ import annotations

import time
from typing import Any

from outbox_dispatch import Backoff, Context, PermanentFailure
from tests.apps.envapp import make_app

app, dispatcher = make_app("flowertest", claim_interval=0.3)
dispatcher.family(
    "seen", max_attempts=3, backoff=Backoff(base=0.2, cap=0.2, jitter=0.0), heartbeat_timeout=3
)
dispatcher.family("bulk", batch=10)


@dispatcher.handler("fl.probe", family="seen")  # the test's probe: Flower sees the events
@dispatcher.handler("fl.ok", family="seen")
def ok(ctx: Context, payload: Any) -> None:
    pass


@dispatcher.handler("fl.flaky", family="seen")
def flaky(ctx: Context, payload: Any) -> None:
    if ctx.attempt == 1:
        raise ConnectionError("provider down")


@dispatcher.handler("fl.park", family="seen")
def park(ctx: Context, payload: Any) -> None:
    raise PermanentFailure("bad address")


@dispatcher.handler("fl.slow", family="seen")
def slow(ctx: Context, payload: Any) -> None:
    deadline = time.monotonic() + 30
    while not ctx.is_cancelled and time.monotonic() < deadline:
        time.sleep(0.05)


@dispatcher.handler("fl.batch", family="bulk")
def batch(ctx: Context, payload: Any) -> None:
    pass
