"""A least-privilege role layout: a *migrate* role that owns the outbox schema and runs
``outbox-dispatch migrate``, and a *runtime* role for producers, workers and beat that reads and
writes rows but cannot change the schema.

The runtime path needs nothing beyond table privileges: advisory locks, LISTEN/NOTIFY,
``gen_random_uuid()`` and identity columns need no grants. Default privileges grant the runtime
role the tables (and sequences) that later migrations add.

The roles themselves are not created here (their login and password are the DBA's business);
the statements run as a superuser, or as a role that is a member of the migrate role and may
grant on the database.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from outbox_dispatch.core.errors import ConfigurationError, InvalidIdentifier
from outbox_dispatch.core.naming import quoted
from outbox_dispatch.store.connections import translated

TABLE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
SEQUENCE_PRIVILEGES = "USAGE, SELECT"

# Role and database names are looser than our identifiers (``app-runtime`` is common) but never
# hold a quote or a dollar sign, so they can be quoted, and put in a literal and a DO body, as is.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,62}$")


def _q(name: object, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidIdentifier(
            f"{what} {name!r} is not a valid name: use 1-63 letters, digits, _, - or ., "
            "starting with a letter or _"
        )
    return f'"{name}"'


def role_sql(
    schema: str, *, migrate_role: str, runtime_role: str, database: str | None = None
) -> list[str]:
    """The statements of the layout for ``schema``, in order; idempotent.

    Run before the first migrate (the migrate role then creates every table) or after it: the
    schema's existing tables are handed to the migrate role.
    """
    s = quoted(schema)
    mig = _q(migrate_role, "migrate role")
    run = _q(runtime_role, "runtime role")
    if migrate_role == runtime_role:
        raise ConfigurationError(
            "the migrate and runtime roles must differ: the runtime role must not own the schema"
        )
    statements = []
    if database is not None:
        db = _q(database, "database")
        statements.append(f"GRANT CONNECT ON DATABASE {db} TO {mig}, {run}")
    statements += [
        f"CREATE SCHEMA IF NOT EXISTS {s} AUTHORIZATION {mig}",
        f"ALTER SCHEMA {s} OWNER TO {mig}",
        # tables made before the layout (a schema migrated as another role) go to the migrate
        # role too; their identity sequences and indexes follow their table
        f"""DO $$
DECLARE t regclass;
BEGIN
    FOR t IN SELECT c.oid::regclass FROM pg_class c
             WHERE c.relnamespace = '{s}'::regnamespace AND c.relkind IN ('r', 'p')
    LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO %s', t, '{mig}');
    END LOOP;
END $$""",
        f"REVOKE ALL ON SCHEMA {s} FROM PUBLIC",
        f"REVOKE CREATE ON SCHEMA {s} FROM {run}",
        f"GRANT USAGE ON SCHEMA {s} TO {run}",
        f"GRANT {TABLE_PRIVILEGES} ON ALL TABLES IN SCHEMA {s} TO {run}",
        f"GRANT {SEQUENCE_PRIVILEGES} ON ALL SEQUENCES IN SCHEMA {s} TO {run}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {mig} IN SCHEMA {s}"
        f" GRANT {TABLE_PRIVILEGES} ON TABLES TO {run}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {mig} IN SCHEMA {s}"
        f" GRANT {SEQUENCE_PRIVILEGES} ON SEQUENCES TO {run}",
        # the schema's functions, where PUBLIC may not execute them
        f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {run}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {mig} IN SCHEMA {s}"
        f" GRANT EXECUTE ON FUNCTIONS TO {run}",
    ]
    return statements


def apply_roles(
    database_url: str, schema: str, *, migrate_role: str, runtime_role: str
) -> list[str]:
    """Apply the layout in one transaction; returns the statements run. Both roles must exist."""
    with (
        translated("role layout"),
        psycopg.connect(database_url, autocommit=True) as conn,
        conn.transaction(),
    ):
        missing = _missing_roles(conn, [migrate_role, runtime_role])
        if missing:
            raise ConfigurationError(
                f"roles {missing} do not exist: create them first "
                "(CREATE ROLE ... LOGIN PASSWORD ...), then apply the layout"
            )
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        statements = role_sql(
            schema, migrate_role=migrate_role, runtime_role=runtime_role, database=row[0]
        )
        for statement in statements:
            conn.execute(statement.encode())
    return statements


def _missing_roles(conn: psycopg.Connection[Any], names: list[str]) -> list[str]:
    found = conn.execute(
        "SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (names,)
    ).fetchall()
    have = {r[0] for r in found}
    return [n for n in names if n not in have]
