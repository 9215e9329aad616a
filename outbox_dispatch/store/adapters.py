"""Where a database URL or a Django DATABASES entry points (host, port, database), so that
the database of a caller's connection can be told apart from the others; and URLs checked
before a pool's background thread would quote them, password included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.core.logs import mask_dsn


def check_database_url(url: str) -> None:
    """A URL libpq cannot parse is refused here, masked, rather than first reported by the
    pool's background thread, whose warning would quote it, password included."""
    import psycopg

    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise ConfigurationError(
            f"database_url {mask_dsn(url)!r} is not a valid PostgreSQL URL or DSN: "
            f"{mask_dsn(str(exc))}"
        ) from exc
    if "@" in str(params.get("host") or ""):
        # libpq ends the password at its first '@': the rest becomes the host, and the
        # server's "could not translate host name" would quote that piece of the password
        raise ConfigurationError(
            f"database_url {mask_dsn(url)!r}: its password holds an '@', which ends it early; "
            "write it as %40"
        )


_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "::1"}


def database_target(params: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(host, port, dbname) as libpq would reach them, from libpq's keys; None when a service
    file decides. The loopback names and socket directories count as one host."""
    if params.get("service") or not params.get("dbname"):
        return None
    host = str(params.get("host") or "")
    if host in _LOCAL_HOSTS or host.startswith("/"):
        host = "local"  # TCP to this machine or its Unix socket: one server either way
    return host, str(params.get("port") or "5432"), str(params["dbname"])


def django_target(settings_dict: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """database_target of a Django DATABASES entry."""
    options = settings_dict.get("OPTIONS") or {}
    return database_target(
        {
            "host": settings_dict.get("HOST"),
            "port": settings_dict.get("PORT"),
            "dbname": settings_dict.get("NAME"),
            "service": options.get("service"),
        }
    )
