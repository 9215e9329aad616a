"""The app of the lifecycle process tests: long handlers, a transactional handler, a load
handler and (with OUTBOX_TEST_CRON=1) a cron schedule ticking every second."""

from __future__ import annotations

import os
import time
from typing import Any

from outbox_dispatch import Backoff, Context
from tests.apps.envapp import SCHEMA, make_app

LEASE = float(os.environ.get("OUTBOX_TEST_LEASE", "3"))
app, dispatcher = make_app("lifecycle_acceptance", claim_interval=0.25, pool_size=6)
dispatcher.family("slow", lease=LEASE, heartbeat_timeout=LEASE, max_attempts=5)
dispatcher.family("txn", lease=LEASE, heartbeat_timeout=LEASE, max_attempts=50)
dispatcher.family("load", lease=LEASE, heartbeat_timeout=LEASE, max_in_flight=100)
dispatcher.family(
    "limited",
    lease=LEASE,
    heartbeat_timeout=LEASE,
    max_attempts=2,
    time_limit=1,
    backoff=Backoff(0.1, 0.2, 0.0),
)


def record(ctx: Context, kind: str, payload: Any) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".runs (row_id, kind, attempt, maybe_applied, pid, tick)'
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (
                ctx.row_id,
                kind,
                ctx.attempt,
                ctx.maybe_applied,
                os.getpid(),
                (payload or {}).get("cron_tick"),
            ),
        )


@dispatcher.handler("slow.run", family="slow")
def slow(ctx: Context, payload: Any) -> None:
    record(ctx, "start", payload)
    time.sleep(payload["sleep"] if ctx.attempt == 1 else 0.01)
    record(ctx, "end", payload)


@dispatcher.handler("job.slow", family="job")  # the built-in family, at its defaults
def job_slow(ctx: Context, payload: Any) -> None:
    slow(ctx, payload)


@dispatcher.handler("txn.write", family="txn", transactional=True)
def write(ctx: Context, payload: Any) -> None:
    ctx.conn.execute(f'INSERT INTO "{SCHEMA}".effects (row_id) VALUES (%s)', (ctx.row_id,))
    time.sleep(payload.get("sleep", 0.03))


@dispatcher.handler("load.run", family="load")
def load(ctx: Context, payload: Any) -> None:
    time.sleep(payload.get("sleep", 0.02))
    record(ctx, "end", payload)


@dispatcher.handler("limited.hang", family="limited")
def hang(ctx: Context, payload: Any) -> None:
    record(ctx, "start", payload)
    time.sleep(payload["sleep"])
    record(ctx, "end", payload)


@dispatcher.handler("limited.stubborn", family="limited")
def stubborn(ctx: Context, payload: Any) -> None:
    """Swallows the soft time limit and goes on: only the hard limit ends it."""
    record(ctx, "start", payload)
    deadline = time.monotonic() + payload["sleep"]
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except BaseException:  # the point: a handler that ignores the soft limit
            record(ctx, "ignored", payload)
    record(ctx, "end", payload)


if os.environ.get("OUTBOX_TEST_CRON"):
    dispatcher.ops.cron("every-second", "* * * * * *", "load.run", {"sleep": 0.001}, catch_up="all")
