"""The Celery app and Dispatcher of a test worker process, configured from the environment the
process tests set (database, schema, Redis url and key prefix)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from outbox_dispatch import Dispatcher

DATABASE_URL = os.environ.get("OUTBOX_TEST_DATABASE_URL", "")
SCHEMA = os.environ.get("OUTBOX_TEST_SCHEMA", "")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "")
KEY_PREFIX = os.environ.get("OUTBOX_TEST_KEY_PREFIX", "")


def make_app(name: str, **options: Any) -> tuple[Celery, Dispatcher]:
    app = Celery(name, broker=REDIS_URL)
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
        **options,
    )
    return app, dispatcher
