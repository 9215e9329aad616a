"""The app of the multi-process caps tests: ``celery -A tests.apps.caps_app worker``.

Handlers record each attempt's start and end in ``runs`` so the tests can measure the
concurrency per actor and the order in which rows ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

from outbox_dispatch import Context
from tests.apps.caps_families import declare_families
from tests.apps.envapp import SCHEMA, make_app

LEASE = float(os.environ.get("OUTBOX_TEST_LEASE", "5"))
HEARTBEAT_TIMEOUT = float(os.environ.get("OUTBOX_TEST_HEARTBEAT_TIMEOUT", "0"))
app, dispatcher = make_app("caps_acceptance", claim_interval=0.25, pool_size=10)


declare_families(dispatcher, LEASE, HEARTBEAT_TIMEOUT)


def _record(ctx: Context, payload: Any, started: float, ok: bool) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".runs (row_id, family, actor, n, attempt, started, ended,'
            " ok, maybe_applied, pid) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                ctx.row_id,
                ctx.family,
                ctx.actor,
                payload.get("n"),
                ctx.attempt,
                started,
                time.time(),
                ok,
                ctx.maybe_applied,
                os.getpid(),
            ),
        )


def _work(ctx: Context, payload: Any) -> None:
    started = time.time()
    if payload.get("mark_start"):
        _record(ctx, payload, started, False)
    time.sleep(payload.get("sleep", 0.02))
    if payload.get("fail") and ctx.attempt == 1:
        _record(ctx, payload, started, False)
        raise RuntimeError("first attempt fails")
    _record(ctx, payload, started, True)


for _family in ("capped", "fair", "lined"):
    dispatcher.handler(f"work.{_family}", family=_family)(_work)
