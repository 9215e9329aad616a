"""The app of the several-databases process test: one Dispatcher over the databases named in
``OUTBOX_TEST_DATABASES`` (JSON name -> URL); its handler records database, row and pool
process in a Redis list, so the test sees every run whatever database is down."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from outbox_dispatch import Context, Dispatcher

DATABASES: dict[str, str] = json.loads(os.environ.get("OUTBOX_TEST_DATABASES", "{}"))
LEASE = 2.0  # a message dropped while its database was down is claimed again soon after


def seen_key(env: Mapping[str, str]) -> str:
    return env["OUTBOX_TEST_KEY_PREFIX"] + "mdb:seen"


def make(databases: dict[str, str], env: Mapping[str, str]) -> tuple[Celery, Dispatcher]:
    """The app and Dispatcher, from the process tests' environment (``env``)."""
    redis_url, prefix = env["OUTBOX_TEST_REDIS_URL"], env["OUTBOX_TEST_KEY_PREFIX"]
    app = Celery("databases_acceptance", broker=redis_url)
    app.conf.update(
        broker_transport_options={"global_keyprefix": prefix},
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    d = Dispatcher(
        app,
        databases=databases,
        redis_url=redis_url,
        schema=env["OUTBOX_TEST_SCHEMA"],
        key_prefix=prefix.rstrip(":"),
        claim_interval=0.25,
    )
    d.family("intent", lease=LEASE)
    return app, d


if DATABASES:  # the worker's process; the test builds its own producer with make()
    app, dispatcher = make(DATABASES, os.environ)
    _redis = redis.Redis.from_url(os.environ["OUTBOX_TEST_REDIS_URL"])
    _seen = seen_key(os.environ)

    @dispatcher.handler("mdb.record")
    def record(ctx: Context, payload: Any) -> None:
        _redis.rpush(_seen, f"{ctx.database}:{ctx.row_id}:{os.getpid()}")
