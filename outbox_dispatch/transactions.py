"""Which transaction a Celery task call belongs to, so that ``task.delay()`` writes its outbox
row there: the connection bound with ``outbox_dispatch.using(conn)`` (psycopg, SQLAlchemy),
else Django's connection to the outbox's database while it is in a transaction
(``transaction.atomic()`` on any alias). Nothing here opens a connection.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from .adapters import caller_connection, database_target, django_target
from .errors import OutsideTransaction

_bound: ContextVar[tuple[object, str | None] | None] = ContextVar(
    "outbox_dispatch_using", default=None
)


@contextmanager
def using(conn: object, *, database: str | None = None) -> Iterator[None]:
    """Task calls (``.delay()``, ``.apply_async()``) inside this block write their rows on
    ``conn``, so they commit or roll back with the caller's transaction: a psycopg 3
    connection, a SQLAlchemy Session or Connection, or a Django connection. ``database``
    names which of the dispatcher's databases ``conn`` is, when a proxy hides it."""
    caller_connection(conn)  # refuse what cannot carry a row now, not at the first call
    token = _bound.set((conn, database))
    try:
        yield
    finally:
        _bound.reset(token)


def bound() -> object | None:
    found = _bound.get()
    return None if found is None else found[0]


def bound_database() -> str | None:
    """The database named by the innermost ``using(..., database=)``, if any."""
    found = _bound.get()
    return None if found is None else found[1]


def django_transaction(database_urls: Sequence[str]) -> Any | None:
    """Django's connection (this thread's) to one of the outbox's databases when it is inside a
    transaction, else None. A transaction open only on another database cannot carry the
    row: that is refused, since writing the row apart from it would be a silent dual write."""
    if "django.db" not in sys.modules:
        return None
    from django.conf import settings

    if not settings.configured:
        return None
    from django.db import connections

    ours, others = [], []
    for conn in connections.all(initialized_only=True):
        in_transaction = conn.in_atomic_block or (
            conn.connection is not None and not conn.get_autocommit()
        )
        if not in_transaction:
            continue
        same = [same_database(conn.settings_dict, url) for url in database_urls]
        # a service file or a default decides (None): taken as ours, the enqueue will tell
        if conn.vendor == "postgresql" and (True in same or None in same):
            ours.append(conn)
        else:
            others.append(conn)
    if len(ours) > 1:
        names = ", ".join(repr(c.alias) for c in ours)
        raise OutsideTransaction(
            f"Django databases {names} are all in a transaction on an outbox database: "
            "say which one carries the task calls with `with outbox_dispatch.using("
            "connections[alias]):`"
        )
    if ours:
        # Django refuses queries in a transaction an error broke; the row bypasses its cursor
        ours[0].validate_no_broken_transaction()
        return ours[0]
    if others:
        names = ", ".join(repr(c.alias) for c in others)
        raise OutsideTransaction(
            f"this task call is inside a transaction on Django database {names}, which is "
            "not the outbox's database, so its row cannot commit with that transaction: "
            "keep the outbox in the same database as the data it follows, or call the task "
            "outside that block"
        )
    return None


def same_database(settings_dict: dict[str, Any], database_url: str) -> bool | None:
    """Whether a Django DATABASES entry names the database of ``database_url``; None when
    either side leaves it to a service file or libpq's defaults."""
    from psycopg.conninfo import conninfo_to_dict

    ours = database_target(conninfo_to_dict(database_url))
    theirs = django_target(settings_dict)
    if ours is None or theirs is None:
        return None
    return theirs == ours
