"""A worker app whose handler kills its own pool process on one row of a batch (kill -9), for
the mid-batch kill test."""

from __future__ import annotations

import os
import signal
from typing import Any

from outbox_dispatch import Context
from tests.acceptance.envapp import SCHEMA, make_app

app, dispatcher = make_app("acceptance-batch", claim_interval=0.3)
dispatcher.family("batchkill", lease=10, heartbeat_timeout=1)


@dispatcher.handler("acc.batchkill", family="batchkill")
def batchkill(ctx: Context, payload: Any) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".effects (row_id, command, attempt, pid, maybe_applied)'
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.row_id, ctx.command, ctx.attempt, os.getpid(), ctx.maybe_applied),
        )
    if payload.get("kill") and ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
