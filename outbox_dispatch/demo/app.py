"""The demo's Celery app, as a user would write one: ``celery -A outbox_dispatch.demo.app``.

Configured from the environment so the demo, the compose stack and the tests share it.
Handlers record each attempt in ``demo_attempts`` so the demo can report what happened.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from celery import Celery

from outbox_dispatch import Backoff, Context, Dispatcher

DATABASE_URL = os.environ.get(
    "OUTBOX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("OUTBOX_REDIS_URL", "redis://127.0.0.1:6379/5")
SCHEMA = os.environ.get("OUTBOX_SCHEMA", "outbox_demo")

app = Celery("outbox_demo", broker=REDIS_URL)
app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False)
dispatcher = Dispatcher(
    app, database_url=DATABASE_URL, redis_url=REDIS_URL, schema=SCHEMA, claim_interval=0.5
)
# e-mails go out in batched messages of up to 20 rows: one broker message, one start and one
# settle statement for all of them
dispatcher.family("email", max_attempts=5, lease=30, batch=20)
dispatcher.family("webhook", max_attempts=4, lease=30, backoff=Backoff(base=0.3, cap=2.0))
dispatcher.family("report", max_attempts=3, lease=30, backoff=Backoff(base=0.3, cap=1.0))


def record(ctx: Context, ok: bool) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".demo_attempts (row_id, command, attempt, ok)'
            " VALUES (%s, %s, %s, %s)",
            (ctx.row_id, ctx.command, ctx.attempt, ok),
        )


@dispatcher.handler("email.send", family="email")
def send_email(ctx: Context, payload: dict[str, Any]) -> None:
    time.sleep(0.001)  # a quick call to a mail API
    record(ctx, True)


@dispatcher.handler("webhook.post", family="webhook")
def post_webhook(ctx: Context, payload: dict[str, Any]) -> None:
    time.sleep(0.002)
    if payload.get("flaky") and ctx.attempt == 1:
        record(ctx, False)
        raise ConnectionError(f"{payload['url']} answered 503 (first attempt)")
    record(ctx, True)


@dispatcher.handler("report.build", family="report")
def build_report(ctx: Context, payload: dict[str, Any]) -> None:
    time.sleep(random.uniform(0.002, 0.006))
    if payload.get("broken"):
        record(ctx, False)
        raise ValueError(f"report {payload['report']} has no data source")
    record(ctx, True)
