"""A worker app whose handler kills its own pool process on one row of a batch (kill -9), for
the mid-batch kill tests."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from outbox_dispatch import Context
from tests.apps.envapp import SCHEMA, make_app

# one consumer: a claim of 8 rows packs them 2 to a message
app, dispatcher = make_app("acceptance-batch", claim_interval=0.3, consumers=1)
dispatcher.family("batchkill", lease=10, heartbeat_timeout=1)
# one row per message, short handlers
dispatcher.family("feedkill", batch=1, lease=5, heartbeat_timeout=1, max_in_flight=40)


@dispatcher.handler("acc.batchkill", family="batchkill")
@dispatcher.handler("acc.feedkill", family="feedkill")
def batchkill(ctx: Context, payload: Any) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".effects (row_id, command, attempt, pid, maybe_applied)'
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.row_id, ctx.command, ctx.attempt, os.getpid(), ctx.maybe_applied),
        )
    if payload.get("block") and ctx.attempt == 1:
        time.sleep(60)  # the test kills the worker meanwhile
    if payload.get("kill") and ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
