"""The Dispatcher's database from Django's ``DATABASES``, so the URL is written once:
``Dispatcher(app, database_url=database_url("default"))``."""

from __future__ import annotations

from typing import Any

from outbox_dispatch.core.errors import ConfigurationError

# Keys of a DATABASES entry's OPTIONS that belong to Django's backend, not to libpq.
_DJANGO_ONLY = {
    "isolation_level",
    "pool",
    "server_side_binding",
    "assume_role",
    "cursor_factory",
    "context",
}


def database_url(alias: str = "default") -> str:
    """A libpq connection string for ``settings.DATABASES[alias]``: NAME, USER, PASSWORD,
    HOST, PORT and the OPTIONS libpq knows (``sslmode``, ``options``, ``service``...).

    Reads the settings only (no connection, no ``django.setup()``), so it works where a Celery
    app builds its Dispatcher at import time, once ``DJANGO_SETTINGS_MODULE`` is set."""
    from django.conf import settings
    from psycopg.conninfo import make_conninfo

    databases: dict[str, dict[str, Any]] = settings.DATABASES
    if alias not in databases:
        known = ", ".join(sorted(databases)) or "none"
        raise ConfigurationError(f"Django has no database {alias!r} in DATABASES (it has: {known})")
    entry = databases[alias]
    engine = str(entry.get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        raise ConfigurationError(
            f"Django database {alias!r} uses {engine or 'no ENGINE'}: the outbox lives in "
            "PostgreSQL (django.db.backends.postgresql)"
        )
    params: dict[str, Any] = {
        key: value
        for key, value in (entry.get("OPTIONS") or {}).items()
        if key not in _DJANGO_ONLY and value is not None
    }
    for libpq, django_key in (
        ("dbname", "NAME"),
        ("user", "USER"),
        ("password", "PASSWORD"),
        ("host", "HOST"),
        ("port", "PORT"),
    ):
        value = entry.get(django_key)
        if value not in (None, ""):
            params[libpq] = str(value)
    return make_conninfo("", **params)
