"""The app of the multi-process caps tests: ``celery -A tests.acceptance.caps_app worker``.

Handlers record each attempt's start and end in ``runs`` so the tests can measure the
concurrency per actor and the order in which rows ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from outbox_dispatch import Context, Dispatcher
from tests.acceptance.caps_families import declare_families

DATABASE_URL = os.environ["OUTBOX_TEST_DATABASE_URL"]
SCHEMA = os.environ["OUTBOX_TEST_SCHEMA"]
REDIS_URL = os.environ["OUTBOX_TEST_REDIS_URL"]
KEY_PREFIX = os.environ["OUTBOX_TEST_KEY_PREFIX"]
LEASE = float(os.environ.get("OUTBOX_TEST_LEASE", "5"))

app = Celery("caps_acceptance", broker=REDIS_URL)
app.conf.update(
    broker_transport_options={"global_keyprefix": KEY_PREFIX},
    task_ignore_result=True,
    worker_hijack_root_logger=False,
)
dispatcher = Dispatcher(
    app,
    database_url=DATABASE_URL,
    redis_url=REDIS_URL,
    schema=SCHEMA,
    key_prefix=KEY_PREFIX.rstrip(":"),
    claim_interval=0.25,
    pool_size=10,
)


declare_families(dispatcher, LEASE)


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
