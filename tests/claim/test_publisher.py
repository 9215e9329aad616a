"""The fast publish path sends the message Celery's own send path would, field by field."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from celery import Celery, signals

from outbox_dispatch import Dispatcher
from outbox_dispatch.claim.publisher import Publisher, message_options
from outbox_dispatch.core.rows import Claimed


class Recorder:
    """Stands in for a kombu Producer: keeps what would be sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.sent.append((body, kwargs))


@pytest.fixture
def dispatcher() -> Dispatcher:
    app = Celery("pub", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url="postgresql://nobody@127.0.0.1:1/none", listen=False)
    d.family("limited", time_limit=5)
    app.conf.task_queues  # noqa: B018 (finalize the configuration: our queues are merged in)
    return d


@pytest.mark.parametrize("family", ["intent", "limited"])
def test_fast_message_matches_celerys(dispatcher: Dispatcher, family: str) -> None:
    fam = dispatcher.families[family]
    queue = dispatcher.queue_name(family)
    row = Claimed(42, uuid.uuid4(), "email.send", "customer-7", 3)
    ours, theirs = Recorder(), Recorder()

    dispatcher.runtime.publisher._send(
        ours, queue, [((row.id, str(row.token)), message_options(fam, row, queue))]
    )
    options = message_options(fam, row, queue)
    task = dispatcher.runtime.deliver_task
    message = dispatcher.app.amqp.create_task_message(
        "id-1",
        task.name,
        (row.id, str(row.token)),
        {},
        ignore_result=True,
        shadow=options["shadow"],
        argsrepr=options["argsrepr"],
        kwargsrepr=options["kwargsrepr"],
        time_limit=options.get("time_limit"),
        soft_time_limit=options.get("soft_time_limit"),
    )
    dispatcher.app.amqp.send_task_message(theirs, task.name, message, queue=queue)

    [(our_body, our_kw)] = ours.sent
    [(their_body, their_kw)] = theirs.sent
    assert json.loads(our_body) == json.loads(json.dumps(their_body))
    task_id = our_kw["headers"]["id"]
    assert our_kw["headers"] == {**their_kw["headers"], "id": task_id, "root_id": task_id}
    assert our_kw["correlation_id"] == task_id
    for key in ("exchange", "routing_key", "delivery_mode", "declare", "reply_to"):
        assert our_kw[key] == their_kw[key], key
    assert our_kw["content_type"] == "application/json"  # the worker accepts JSON only
    if family == "limited":
        assert our_kw["headers"]["timelimit"] == [5.0 + 1.0, 5.0]


def test_publish_signal_listeners_get_celerys_own_path(dispatcher: Dispatcher) -> None:
    seen: list[Any] = []

    def listener(sender: Any = None, **kw: Any) -> None:
        seen.append(kw["headers"]["shadow"])

    publisher = Publisher(dispatcher.app, dispatcher.runtime.deliver_task)
    queue = dispatcher.queue_name("intent")
    assert not publisher._needs_celery_path(queue)
    signals.before_task_publish.connect(listener, weak=False)
    try:
        assert publisher._needs_celery_path(queue)
        row = Claimed(1, uuid.uuid4(), "email.send", None, 1)
        publisher.publish(dispatcher.families["intent"], [row], dispatcher.queue_name("intent"))
    finally:
        signals.before_task_publish.disconnect(listener)
    assert seen == ["intent:email.send"]
