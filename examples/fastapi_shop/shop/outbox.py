"""The shop's Celery app, its Dispatcher and the handler that confirms an order.

The handler runs in a Celery worker process (``celery -A shop.outbox worker -B``), as a plain
function: it may run more than once for one order (at least once), so it writes its effect
idempotently.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery

from outbox_dispatch import Context, Dispatcher

from .db import DATABASE_URL

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# every Redis key of this shop (Celery's queues, the outbox's cap keys) under one prefix, so
# that several shops (or test runs) can share one Redis
KEY_PREFIX = os.environ.get("REDIS_KEY_PREFIX", "shop:")

app = Celery("shop", broker=REDIS_URL)
app.conf.broker_transport_options = {"global_keyprefix": KEY_PREFIX}

dispatcher = Dispatcher(
    app,
    database_url=DATABASE_URL,
    redis_url=REDIS_URL,
    schema=os.environ.get("OUTBOX_SCHEMA", "outbox"),
    key_prefix=f"{KEY_PREFIX}outbox",
)
dispatcher.family("mail", max_attempts=5)


@dispatcher.handler("order.confirm", family="mail")
def send_confirmation(ctx: Context, payload: dict[str, Any]) -> None:
    """Sends the order's confirmation (here: a row of the confirmations table), once however
    many times this runs for the order."""
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute(
            "INSERT INTO confirmations (order_id, email) VALUES (%s, %s)"
            " ON CONFLICT (order_id) DO NOTHING",
            (payload["order"], payload["email"]),
        )
