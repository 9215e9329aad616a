"""The shop's Celery app.

Before the outbox this read ``app = Celery("shop", broker=BROKER_URL, include=[...])``. The
one-line change is ``task_cls=OutboxTask``: every task's ``.delay()`` inside a transaction
now writes an outbox row that commits with it, and the tasks and their call sites stay as
they were. The Dispatcher is what the workers deliver those rows with.
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_dispatch import Dispatcher, OutboxTask

DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")

app = Celery("shop", broker=BROKER_URL, include=["shop.tasks"], task_cls=OutboxTask)
app.conf.broker_transport_options = {"global_keyprefix": os.environ.get("SHOP_KEY_PREFIX", "")}

dispatcher = Dispatcher(
    app,
    database_url=DATABASE_URL,
    schema=os.environ.get("SHOP_OUTBOX_SCHEMA", "outbox"),
    claim_interval=0.5,
)
