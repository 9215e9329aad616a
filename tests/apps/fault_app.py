"""The app of the fault process tests: a handler that kills its own pool process every time,
next to an ordinary handler in the same family (same queue, same pool)."""

from __future__ import annotations

import os
import signal
from typing import Any

from outbox_dispatch import Context
from tests.apps.envapp import SCHEMA, make_app

LEASE = float(os.environ.get("OUTBOX_TEST_LEASE", "1.5"))
MAX_ATTEMPTS = int(os.environ.get("OUTBOX_TEST_MAX_ATTEMPTS", "3"))

app, dispatcher = make_app("fault_acceptance", claim_interval=0.25)
dispatcher.family("suicide", lease=LEASE, heartbeat_timeout=LEASE, max_attempts=MAX_ATTEMPTS)


def record(ctx: Context, kind: str) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".runs (row_id, kind, attempt, maybe_applied, pid)'
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.row_id, kind, ctx.attempt, ctx.maybe_applied, os.getpid()),
        )


@dispatcher.handler("fault.suicide", family="suicide")
def suicide(ctx: Context, payload: Any) -> None:
    record(ctx, "start")
    os.kill(os.getpid(), signal.SIGKILL)  # every time: a segfaulting C extension, an OOM kill


@dispatcher.handler("fault.ok", family="suicide")
def ok(ctx: Context, payload: Any) -> None:
    record(ctx, "ok")
