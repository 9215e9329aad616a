"""Enqueue from Django: the outbox row is written on Django's own connection, so it commits or
rolls back with the models saved in the same ``transaction.atomic`` block.

```python
from django.db import transaction
from outbox_dispatch.contrib.django import enqueue

with transaction.atomic():
    order = Order.objects.create(...)
    enqueue("email.send", {"order": order.pk}, dedupe_key=f"receipt:{order.pk}")
```

Outside a transaction each statement commits on its own, so the row could exist without the
business change (or the change without the row, if the process dies in between): these
helpers refuse that unless you pass ``allow_autocommit=True``.

Waking the claimer. The insert also sends a ``NOTIFY`` that Postgres delivers only at commit;
with ``Dispatcher(listen=True)`` (the default) a worker's listener claims at once and a second
wake would only add a claim pass per request. So a Celery wake
(``dispatcher.runtime.request_claim``, one claim task) is registered with
``transaction.on_commit`` only when the dispatcher does not listen, only for rows due now, and
at most once per family per transaction (also when the same family is enqueued many times, or
again after a savepoint that registered it was rolled back). It runs only after the commit,
never after a rollback; if the process dies between the commit
and the wake, beat's claim entry finds the row within ``claim_interval``. Under manual
transaction management (autocommit off, no atomic block) Django has no ``on_commit``, and
the row waits for the listener or beat.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.transaction import TransactionManagementError

from outbox_dispatch.celery.transactions import wake_on_commit
from outbox_dispatch.contrib.django.apps import get_dispatcher
from outbox_dispatch.contrib.django.database import database_url
from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.core.validation import Message

__all__ = ["NotInTransaction", "database_url", "enqueue", "enqueue_many", "get_dispatcher"]


class NotInTransaction(OutboxError, TransactionManagementError):  # type: ignore[misc]
    """Enqueue outside a transaction would commit the row on its own: wrap the business change
    and the enqueue in ``transaction.atomic()``, or pass ``allow_autocommit=True``."""


def enqueue(
    command: str,
    payload: Any = None,
    *,
    using: str = DEFAULT_DB_ALIAS,
    actor: str | None = None,
    dedupe_key: str | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
    allow_autocommit: bool = False,
) -> int:
    """Write one outbox row on ``connections[using]`` in its current transaction; returns the
    row id (an existing row's id when ``dedupe_key`` already has one)."""
    dispatcher = get_dispatcher()
    connection = _transaction_of(using, allow_autocommit)
    row_id = dispatcher.enqueue(
        connection,
        command,
        payload,
        actor=actor,
        dedupe_key=dedupe_key,
        delay=delay,
        at=at,
    )
    if _due_now(delay, at):
        wake_on_commit(connection, dispatcher, [dispatcher.registry.family_of(command)])
    return row_id


def enqueue_many(
    messages: Iterable[Message],
    *,
    using: str = DEFAULT_DB_ALIAS,
    allow_autocommit: bool = False,
) -> list[int]:
    """Write a batch of ``Message`` rows in one round trip on ``connections[using]``; ids come
    back in input order, and nothing is written when any message is invalid."""
    dispatcher = get_dispatcher()
    batch: Sequence[Message] = list(messages)
    connection = _transaction_of(using, allow_autocommit)
    ids = dispatcher.enqueue_many(connection, batch)
    families = [dispatcher.registry.family_of(m.command) for m in batch if _due_now(m.delay, m.at)]
    wake_on_commit(connection, dispatcher, families)
    return ids


def _transaction_of(using: str, allow_autocommit: bool) -> Any:
    """Django's connection for ``using``, checked to be inside a transaction that can still
    commit, and with that transaction begun on the server."""
    connection = connections[using]
    if connection.get_autocommit() and not allow_autocommit:
        raise NotInTransaction(
            f"enqueue on database {using!r} outside a transaction would commit the outbox row "
            "on its own, apart from your business change: wrap both in "
            "`with transaction.atomic():`, or pass allow_autocommit=True if that is what you "
            "want"
        )
    # Django would refuse any query here; the enqueue bypasses its cursor, so ask the same.
    connection.validate_no_broken_transaction()
    return connection


def _due_now(delay: timedelta | None, at: datetime | None) -> bool:
    """The same rule as the insert's NOTIFY: a delayed or scheduled row has nothing to wake."""
    return at is None and (delay is None or delay == timedelta(0))
