"""Delivery messages onto the broker, fast.

A claim publishes hundreds of messages that differ only in row id, token and display fields,
and ``apply_async`` rebuilds the whole Celery message, route and retry policy for each one.
Here Celery builds one message per claim, which is the template; each row's message is a copy
with its own task id, args and display fields, sent as pre-serialized JSON through one
pipelined producer. The result is the message ``apply_async`` would send from outside a task (a
test compares them field by field); each delivery is its own root in Flower, not a child of
the claim task that published it.

Whoever listens to Celery's publish signals (tracing integrations, tests) or asked for
task-sent events gets ``apply_async`` itself, so nothing they rely on is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery, signals

from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Claimed

_DISPLAY = ("shadow", "argsrepr", "kwargsrepr")

Outgoing = list[tuple[tuple[Any, ...], dict[str, Any]]]  # (task args, publish options)


Namer = Callable[[Family, str], str]  # the name Flower shows for a family's command


def family_command(family: Family, command: str) -> str:
    return f"{family.name}:{command}"


@dataclass(frozen=True)
class Wire:
    """One delivery message as the broker carries it: what ``apply_async`` would send."""

    task_id: str
    body: str  # JSON: [args, kwargs, embed]
    headers: dict[str, Any]
    properties: dict[str, Any]


class Publisher:
    def __init__(self, app: Celery, task: Any, name: Namer = family_command) -> None:
        self.app = app
        self.task = task  # outbox.deliver
        self.name = name
        # Celery's message per task name, built once per process: its origin names the pid
        self._templates: dict[str, tuple[dict[str, Any], dict[str, Any], Any]] = {}
        self._templates_pid = 0

    def publish(
        self,
        family: Family,
        rows: Sequence[Claimed],
        queue: str,
        size: int = 1,
        database: str | None = None,
    ) -> int:
        """One message per row, or per ``size`` rows, on one producer, one pipeline; returns
        how many. ``database``: the name the messages carry (None for the first database,
        whose messages carry none; databases.py)."""
        messages: Outgoing = []
        step = max(1, size)
        head: tuple[Any, ...] = () if database is None else (database,)
        for i in range(0, len(rows), step):
            chunk = rows[i : i + step]
            if len(chunk) == 1:  # a lone row keeps the one-row message (and its Flower name)
                row = chunk[0]
                options = message_options(family, row, queue, self.name, database)
                messages.append(((*head, row.id, str(row.token)), options))
            else:
                pairs = [[r.id, str(r.token)] for r in chunk]
                options = batch_options(family, chunk, queue, self.name, database)
                messages.append(((*head, pairs), options))
        if self._needs_celery_path(queue):
            with self.app.producer_or_acquire() as producer, _batched(producer, len(messages)):
                for args, options in messages:
                    self.task.apply_async(args, producer=producer, **options)
            return len(messages)
        wires = self.wires(queue, messages)
        self.send(queue, wires)
        return len(wires)

    def send(self, queue: str, wires: Sequence[Wire]) -> None:
        """Put messages on the broker: one producer, one pipeline."""
        with self.app.producer_or_acquire() as producer, _batched(producer, len(wires)):
            self._put(producer, queue, wires)

    def _needs_celery_path(self, queue: str) -> bool:
        """Publish signals have listeners, sent events are on, or the user routed our queue
        through an exchange that is not direct: Celery's own path then, not the template."""
        exchange = getattr(self.app.amqp.queues.get(queue), "exchange", None)
        return bool(
            signals.before_task_publish.receivers
            or signals.after_task_publish.receivers
            or self.app.conf.task_send_sent_event
            or getattr(exchange, "type", "direct") != "direct"
        )

    def _send(self, producer: Any, queue: str, messages: Outgoing) -> None:
        self._put(producer, queue, self.wires(queue, messages))

    def wires(self, queue_name: str, messages: Outgoing) -> list[Wire]:
        """The messages as the broker carries them: each a copy of its task's template with
        its own task id, args, time limits and display fields."""
        out = []
        for args, options in messages:
            headers0, properties0, embed = self._template(self.task)
            task_id = str(uuid.uuid4())
            headers = {**headers0, "id": task_id, "root_id": task_id}
            for key in _DISPLAY:
                headers[key] = options[key]
            # a batched family's rows vary in number; their limits come with each message
            headers["timelimit"] = [options.get("time_limit"), options.get("soft_time_limit")]
            body = json.dumps([list(args), {}, embed])
            out.append(Wire(task_id, body, headers, {**properties0, "correlation_id": task_id}))
        return out

    def _template(self, task: Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """The message Celery builds for ``task`` (headers, properties, the body's embed),
        once per process: building it is most of a lone message's cost on the commit wake's
        path, and nothing in it varies but what ``wires`` sets."""
        if self._templates_pid != os.getpid():
            self._templates, self._templates_pid = {}, os.getpid()
        found = self._templates.get(task.name)
        if found is None:
            headers0, properties0, body0, _ = self.app.amqp.create_task_message(
                "template", task.name, (), {}, ignore_result=True
            )
            found = self._templates[task.name] = (headers0, properties0, body0[2])
        return found

    def _put(self, producer: Any, queue_name: str, wires: Sequence[Wire]) -> None:
        conf = self.app.conf
        queue = self.app.amqp.queues[queue_name]
        delivery_mode = getattr(queue.exchange, "delivery_mode", None) or (
            conf.task_default_delivery_mode
        )
        declare: list[Any] | None = [queue]
        for wire in wires:
            producer.publish(
                wire.body,
                exchange="",  # direct to the queue, as Celery does for a direct exchange
                routing_key=queue_name,
                content_type="application/json",
                content_encoding="utf-8",
                compression=conf.task_compression,
                retry=conf.task_publish_retry,
                retry_policy=conf.task_publish_retry_policy,
                delivery_mode=delivery_mode,
                declare=declare,
                headers=wire.headers,
                **wire.properties,
            )
            declare = None  # declared once per claim, not per message


@contextlib.contextmanager
def _batched(producer: Any, messages: int) -> Iterator[None]:
    """Publish through one pipeline per claim (kombu >= 5.7's Producer.batch): the messages
    leave together when the block ends, after the claim committed. A lone message goes
    straight out: the pipeline would cost more than it saves (redis-py builds each one with
    its own copy of the response callbacks, on the commit wake's path)."""
    batch = getattr(producer, "batch", None)
    if batch is None or messages <= 1:
        yield
        return
    with batch(max_size=1000):
        yield


def _shown_database(database: str | None) -> str:
    return "" if database is None else f"database={database!r}, "


def message_options(
    family: Family,
    row: Claimed,
    queue: str,
    name: Namer = family_command,
    database: str | None = None,
) -> dict[str, Any]:
    """Celery publish options: Flower shows ``<family>:<command>`` (a Celery task's own name
    for its calls) with row id and actor, and the database when it is not the first."""
    where = _shown_database(database)
    return {
        "queue": queue,
        "routing_key": queue,
        "shadow": name(family, row.command),
        "argsrepr": f"({where}row={row.id}, actor={row.actor!r}, attempt={row.attempts})",
        "kwargsrepr": "{}",
        **_time_limits(family, 1),
    }


def _time_limits(family: Family, rows: int) -> dict[str, float]:
    """Celery's per-message limits; prefork workers enforce them (the heartbeat thread ends
    the lease in any pool)."""
    hard = family.hard_time_limit()
    if family.time_limit is None or hard is None:
        return {}
    return {"soft_time_limit": family.time_limit * rows, "time_limit": hard * rows}


def batch_options(
    family: Family,
    rows: Sequence[Claimed],
    queue: str,
    name: Namer = family_command,
    database: str | None = None,
) -> dict[str, Any]:
    """Celery publish options of a batched message: Flower shows the family and the row ids."""
    commands = sorted({r.command for r in rows})
    shown = name(family, commands[0]) if len(commands) == 1 else f"{family.name}:mixed"
    return {
        "queue": queue,
        "routing_key": queue,
        "shadow": f"{shown}[{len(rows)}]",
        "argsrepr": f"({_shown_database(database)}rows={[r.id for r in rows]})",
        "kwargsrepr": "{}",
        **_time_limits(family, len(rows)),
    }
