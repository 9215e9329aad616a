"""The caller's connection, whatever holds it: the outbox row must be written on the
connection of the caller's own transaction, so that it commits (or rolls back) with the
business change. psycopg 3 connections are taken as they are; Django's connection and
SQLAlchemy sessions and connections are unwrapped to the psycopg connection inside."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox_dispatch.core.errors import ConfigurationError, InvalidArgument
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.pool import Conn


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


def caller_connection(conn: object) -> Conn:
    """The psycopg connection of the caller's transaction: given directly, or inside a
    SQLAlchemy Session or Connection (on the psycopg 3 driver, ``postgresql+psycopg://``)."""
    import psycopg

    if isinstance(conn, psycopg.Connection):
        return conn
    module = type(conn).__module__
    if module.startswith("sqlalchemy"):
        return _from_sqlalchemy(conn)
    if module.startswith("django.") or (
        hasattr(conn, "vendor") and hasattr(conn, "ensure_connection")  # a custom backend
    ):
        return _from_django(conn)
    raise InvalidArgument(
        f"enqueue needs the connection of your transaction (a psycopg 3 Connection, a "
        f"SQLAlchemy Session or Connection, or Django's connection), got {type(conn).__name__}: "
        "the row must commit with your business change"
    )


def _from_django(conn: Any) -> Conn:
    """Django's ``connection`` (or ``connections[alias]``) on the psycopg 3 backend."""
    import psycopg

    if getattr(conn, "vendor", None) != "postgresql":
        raise InvalidArgument(
            f"Django database {getattr(conn, 'alias', '?')!r} is {getattr(conn, 'vendor', '?')}: "
            "the outbox lives in PostgreSQL"
        )
    conn.ensure_connection()
    raw = conn.connection
    if not isinstance(raw, psycopg.Connection):
        raise InvalidArgument(
            f"Django uses {type(raw).__module__} for database {conn.alias!r}: outbox_dispatch "
            "needs psycopg 3 (pip install 'psycopg[binary]'; Django >= 4.2 picks it up)"
        )
    return raw


def _from_sqlalchemy(conn: Any) -> Conn:
    import psycopg
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        conn = conn.connection()  # begins the session's transaction if it has none
    if isinstance(conn, Connection):
        raw = conn.connection.driver_connection
        if isinstance(raw, psycopg.Connection):
            return raw
        raise InvalidArgument(
            f"SQLAlchemy uses the {conn.dialect.driver!r} driver: outbox_dispatch needs psycopg 3 "
            "(a postgresql+psycopg:// URL)"
        )
    raise InvalidArgument(
        f"enqueue cannot use a {type(conn).__name__}: pass a Session or Connection"
    )
