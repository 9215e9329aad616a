"""A user's Celery app for the acceptance tests, configured from the environment the tests set:
``celery -A tests.acceptance.app worker -B`` runs it as a separate process."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from outbox_dispatch import Backoff, Context, Dispatcher

DATABASE_URL = os.environ["OUTBOX_TEST_DATABASE_URL"]
SCHEMA = os.environ["OUTBOX_TEST_SCHEMA"]
REDIS_URL = os.environ["OUTBOX_TEST_REDIS_URL"]
KEY_PREFIX = os.environ["OUTBOX_TEST_KEY_PREFIX"]

app = Celery("acceptance", broker=REDIS_URL)
app.conf.update(
    broker_transport_options={"global_keyprefix": KEY_PREFIX},
    task_ignore_result=True,
    worker_hijack_root_logger=False,
)
dispatcher = Dispatcher(
    app, database_url=DATABASE_URL, redis_url=REDIS_URL, schema=SCHEMA, claim_interval=0.3
)
dispatcher.family("custom", max_attempts=2, lease=10, backoff=Backoff(base=0.1, cap=0.2))


def _record(ctx: Context) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".effects (row_id, command, attempt, pid)'
            " VALUES (%s, %s, %s, %s)",
            (ctx.row_id, ctx.command, ctx.attempt, os.getpid()),
        )


@dispatcher.handler("acc.email", family="intent")
def email(ctx: Context, payload: Any) -> None:
    _record(ctx)


@dispatcher.handler("acc.custom", family="custom")
def custom(ctx: Context, payload: Any) -> None:
    _record(ctx)
    if payload.get("fail"):
        raise RuntimeError("custom handler refuses this payload")
