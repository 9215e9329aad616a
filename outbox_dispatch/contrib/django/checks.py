"""System checks (``manage.py check``, runserver, migrate): catch a missing or broken
``OUTBOX_DISPATCHER`` and a database the outbox cannot share a transaction with before the
first request does. They read settings only and open no connection."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from django.conf import settings
from django.core.checks import CheckMessage, register
from django.core.checks import Error as CheckError
from django.core.checks import Warning as CheckWarning
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS
from django.db.utils import load_backend

from outbox_dispatch.contrib.django.apps import EXAMPLE, SETTING, configured_spec, get_dispatcher
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.adapters import database_target, django_target

TAG = "outbox_dispatch"


def check_outbox(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    database_url: str | None = None
    try:
        if configured_spec() is None:
            messages.append(
                CheckWarning(
                    f"settings.{SETTING} is not set: outbox_dispatch cannot enqueue or migrate",
                    hint=f"Point it at your Dispatcher, for example {SETTING} = {EXAMPLE}.",
                    id="outbox_dispatch.W001",
                )
            )
        else:
            database_url = get_dispatcher().database_url
    except ImproperlyConfigured as exc:
        messages.append(
            CheckError(
                str(exc),
                hint=f"{SETTING} names 'module:attribute' of an outbox_dispatch.Dispatcher "
                "(or of the Celery app it was built on), importable from this project.",
                id="outbox_dispatch.E001",
            )
        )
    databases = getattr(settings, "DATABASES", {})
    return messages + database_problems(databases, DEFAULT_DB_ALIAS, database_url)


register(check_outbox, TAG)  # not as a decorator: Django's register is untyped


def database_problems(
    databases: Mapping[str, Mapping[str, Any]], alias: str, database_url: str | None
) -> list[CheckMessage]:
    """Why enqueue on ``connections[alias]`` would fail, or write rows the dispatcher (which
    claims from ``database_url``) never sees."""
    conf = databases.get(alias)
    if conf is None:
        return [
            CheckWarning(
                f"DATABASES has no {alias!r} database: outbox_dispatch enqueues on it",
                hint="Configure it, or pass using=<alias> to enqueue().",
                id="outbox_dispatch.W002",
            )
        ]
    try:
        vendor = load_backend(conf.get("ENGINE", "")).DatabaseWrapper.vendor
    except Exception:  # a missing or unusable ENGINE: Django reports it itself
        return []
    if vendor != "postgresql":
        return [
            CheckWarning(
                f"database {alias!r} is {vendor}: the outbox lives in PostgreSQL, so enqueue on "
                "this connection is refused",
                hint="Use django.db.backends.postgresql (psycopg 3 or psycopg2) for the database "
                "that holds the models you enqueue with.",
                id="outbox_dispatch.W002",
            )
        ]
    if database_url is None:
        return []
    django_side = django_target(conf)
    try:
        dispatcher_side = database_target(psycopg.conninfo.conninfo_to_dict(database_url))
    except psycopg.ProgrammingError:
        return []  # the Dispatcher reports its own unparsable URL when it connects
    if django_side is None or dispatcher_side is None or django_side == dispatcher_side:
        return []
    return [
        CheckWarning(
            f"database {alias!r} ({_show(django_side)}) is not the dispatcher's database "
            f"({mask_dsn(database_url)}): rows enqueued through Django would never be claimed",
            hint="Build the Dispatcher with the URL of Django's database. If both name the same "
            "server differently, add outbox_dispatch.W004 to SILENCED_SYSTEM_CHECKS.",
            id="outbox_dispatch.W004",
        )
    ]


def _show(target: tuple[str, str, str]) -> str:
    host, port, dbname = target
    return f"{dbname} on {host}:{port}"
