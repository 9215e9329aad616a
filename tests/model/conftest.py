"""The model's environment: a Dispatcher of its own on the session's schema, with the
families under test, and the connections the invariants read through."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Dispatcher
from tests.model.invariants import CMD, COMMON, FAMILIES, FAMILY_NAMES, SPECS
from tests.model.machine import Env, ModelMachine, _Unwoken, env_handler


@pytest.fixture(scope="module")
def model_env(database_url: str, redis_url: str, schema: str, key_prefix: str) -> Iterator[Env]:
    app = Celery("model_tests", broker="memory://", set_as_current=False)
    app.conf.update(task_ignore_result=True)
    prefix = f"{key_prefix}model{uuid.uuid4().hex[:8]}"
    d = Dispatcher(
        app,
        database_url=database_url,
        redis_url=redis_url,
        schema=schema,
        key_prefix=prefix,
        listen=False,
    )
    for name, spec in SPECS.items():
        assert d.family(name, **COMMON, **spec) == FAMILIES[name]
    d.delivery.on_slot_freed = lambda family, database: None  # a claim request: only a task
    # the deferred settles' thread would settle a batch's successes at a moment of its own;
    # here only the batch's flush at its end settles them (a kill before it loses them)
    d.delivery.deferred._wake = _Unwoken()
    read = psycopg.connect(database_url, autocommit=True)
    tx = psycopg.connect(database_url)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    env = Env(d, database_url, schema, prefix, read, tx, client)
    for name in FAMILY_NAMES:
        d.handler(CMD[name], family=name)(lambda ctx, payload: env_handler(env, ctx, payload))
    ModelMachine.env = env
    yield env
    env.reset()
    d.close()
    read.close()
    tx.close()
    client.close()
