"""Through Celery: the claimer publishes (row id, token) to the family's queue and an
in-process worker delivers; what Flower shows; the app's wiring."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Dispatcher
from outbox_dispatch.celery.wiring import (
    CLAIM_ENTRY,
    CLAIM_TASK,
    DELIVER_ROW_TASK,
    DELIVER_TASK,
    DELIVER_TASKS,
)
from outbox_dispatch.core.timings import SAFETY_INTERVAL
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects

pytestmark = pytest.mark.usefixtures("clean")


def _wait(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_claimer_publishes_ids_and_tokens_and_the_worker_delivers_once(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    email, job = commands(family="intent"), commands(family="quick")
    secret = {"card": "4242-secret", "order": 42}
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = [dispatcher.enqueue(conn, email, secret, actor="order:42") for _ in range(20)]
        ids.append(dispatcher.enqueue(conn, job, secret, actor="order:7"))
    report = dispatcher.runtime.claim_and_publish()
    assert report.claimed == {"intent": 20, "quick": 1}
    _wait(lambda: count_rows(database_url, dispatcher.schema) == 0)
    assert sorted(effects.rows(email) + effects.rows(job)) == sorted(ids)
    # nothing more to claim, nothing delivered twice
    assert dispatcher.runtime.claim_and_publish().total == 0
    time.sleep(0.2)
    assert len(effects.calls) == 21

    deliveries = [m for m in published if m["task"] in DELIVER_TASKS]
    sent: list[int] = []
    for m in deliveries:
        args, kwargs, _embed = m["body"]
        assert kwargs == {}
        pairs = [args] if len(args) == 2 else args[0]  # (row id, token), or a batch of them
        assert all(len(pair) == 2 for pair in pairs)  # never the payload
        sent += [pair[0] for pair in pairs]
        assert "secret" not in repr(m["body"])
        assert m["routing_key"] in ("outbox.intent", "outbox.quick")
    assert sorted(sent) == sorted(ids)
    shown = {m["headers"]["shadow"].split("[")[0] for m in deliveries}
    assert shown == {f"intent:{email}", f"quick:{job}"}
    one = next(m for m in deliveries if m["headers"]["shadow"] == f"quick:{job}")
    assert "actor='order:7'" in one["headers"]["argsrepr"]
    assert f"row={one['body'][0][0]}" in one["headers"]["argsrepr"]
    # the 20 rows of the backlog came packed, each message named with its row count
    packed = [m for m in deliveries if m["headers"]["shadow"].startswith(f"intent:{email}[")]
    assert packed and all("rows=[" in m["headers"]["argsrepr"] for m in packed)


def test_garbage_on_the_delivery_queue_runs_nothing(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    database_url: str,
    worker: object,
) -> None:
    cmd = commands()
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    for task in (dispatcher.app.tasks[name] for name in sorted(DELIVER_TASKS)):
        for args in [(row_id, "00000000-0000-0000-0000-000000000000"), ("drop table",), ()]:
            task.apply_async(args, queue="outbox.intent")
        task.apply_async((row_id,), {"evil": True}, queue="outbox.intent")
    time.sleep(0.5)
    assert effects.calls == []
    assert count_rows(database_url, dispatcher.schema, "claim_token IS NULL") == 1


def test_app_wiring(dispatcher: Dispatcher, celery_app: Celery) -> None:
    conf = celery_app.conf
    assert conf.accept_content == ["json"]
    assert conf.task_serializer == "json"
    assert conf.worker_prefetch_multiplier == 1
    names = [q.name for q in conf.task_queues]
    assert names[0] == "celery"  # the default queue stays
    assert {"outbox.claim", "outbox.intent", "outbox.job", "outbox.quick"} <= set(names)
    entry = conf.beat_schedule[CLAIM_ENTRY]
    assert entry["task"] == CLAIM_TASK
    assert entry["schedule"] == 1.0  # listen=False: beat's pass is the only one
    assert entry["options"]["expires"] == 1.0
    # with commit listeners, the leading listener claims every claim_interval itself and
    # beat's entry is the safety net
    listening = Celery("wiring_listen", set_as_current=False)
    Dispatcher(listening, database_url="postgresql://127.0.0.1/unused", claim_interval=0.5)
    assert listening.conf.beat_schedule[CLAIM_ENTRY]["schedule"] == SAFETY_INTERVAL
    for name in (DELIVER_TASK, DELIVER_ROW_TASK):  # given back if its process dies
        deliver = celery_app.tasks[name]
        assert deliver.acks_late and deliver.reject_on_worker_lost and deliver.ignore_result

    # a family added after Celery is configured gets its queue at once
    dispatcher.family("late_family", max_attempts=2)
    assert "outbox.late_family" in [q.name for q in celery_app.conf.task_queues]
