"""Applies the versioned SQL files under an advisory lock, so concurrent deploys are safe."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import psycopg

from outbox_dispatch.core.errors import DatabaseError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.naming import quoted
from outbox_dispatch.store.sqlfiles import migration_sql, migrations

log = logging.getLogger(__name__)

# Session-level lock id shared by every schema: migrations are rare and short.
_LOCK_SQL = "SELECT pg_advisory_lock(hashtext('outbox_dispatch.migrate'))"
_UNLOCK_SQL = "SELECT pg_advisory_unlock(hashtext('outbox_dispatch.migrate'))"


def latest_version() -> int:
    return migrations()[-1].version


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{quoted(schema)}.outbox_migrations",)
    ).fetchone()
    if not exists or not exists[0]:
        return set()
    rows = conn.execute(f"SELECT version FROM {quoted(schema)}.outbox_migrations").fetchall()
    return {int(r[0]) for r in rows}


def _protect_record(conn: psycopg.Connection[Any], schema: str) -> None:
    """Only the owner records migrations: default privileges (see roles.py) grant the runtime
    role writes on every table of the schema, this one included, and are taken back here."""
    conn.execute(
        """DO $$
DECLARE grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT g.grantee FROM information_schema.role_table_grants g
        JOIN pg_tables t ON t.schemaname = g.table_schema AND t.tablename = g.table_name
        WHERE g.table_schema = %(schema)s AND g.table_name = 'outbox_migrations'
          AND g.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
          AND g.grantee NOT IN (t.tableowner, 'PUBLIC')
    LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON %I.outbox_migrations FROM %I',
                       %(schema)s, grantee);
    END LOOP;
END $$""".replace("%(schema)s", "'" + schema.replace("'", "''") + "'")
    )


@contextlib.contextmanager
def _masked(action: str) -> Iterator[None]:
    """Driver errors as ours, password masked (libpq quotes a URL it cannot parse)."""
    try:
        yield
    except psycopg.Error as exc:
        raise DatabaseError(f"{action} failed: {mask_dsn(str(exc))}") from exc


def migrate(database_url: str, schema: str) -> list[int]:
    """Apply pending migrations; return the versions applied (empty when up to date)."""
    target = quoted(schema)
    applied_now: list[int] = []
    with _masked("migrate"), psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(_LOCK_SQL)
        try:
            # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
            # exists: a migrate role that only owns its schema must not need it
            found = conn.execute("SELECT to_regnamespace(%s)", (target,)).fetchone()
            if found is None or found[0] is None:
                conn.execute(f"CREATE SCHEMA {target}")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {target}.outbox_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            _protect_record(conn, schema)
            done = applied_versions(conn, schema)
            for migration in migrations():
                if migration.version in done:
                    continue
                with conn.transaction():
                    conn.execute(migration_sql(migration, schema).encode())
                    conn.execute(
                        f"INSERT INTO {target}.outbox_migrations (version, name) VALUES (%s, %s)",
                        (migration.version, migration.name),
                    )
                log.info(
                    "migration %04d_%s applied to schema %s",
                    migration.version,
                    migration.name,
                    schema,
                    extra={"action": "migrate", "version": migration.version, "schema": schema},
                )
                applied_now.append(migration.version)
        finally:
            conn.execute(_UNLOCK_SQL)
    return applied_now
