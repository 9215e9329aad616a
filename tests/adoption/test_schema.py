"""``sql/schema.sql`` is the schema the migrations build, exactly: both are applied to fresh
schemas of the test database and their catalogs, as ``pg_dump --schema-only`` prints them,
must be the same."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib import resources

import psycopg
import pytest

from outbox_dispatch.store.migrations import migrate

pytestmark = pytest.mark.usefixtures("clean")

SCHEMA_SQL = resources.files("outbox_dispatch").joinpath("sql", "schema.sql")


def _catalog(database_url: str, schema: str) -> str:
    """The schema's DDL as pg_dump prints it, with the schema's name taken out."""
    dump = subprocess.run(
        ["pg_dump", "--schema-only", "--no-owner", "--no-privileges", "-n", schema, database_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [
        line
        for line in dump.splitlines()
        if line
        and not line.startswith(("--", "SET ", "SELECT pg_catalog.", "\\restrict", "\\unrestrict"))
    ]
    return re.sub(rf"\b{re.escape(schema)}\b", "__SCHEMA__", "\n".join(lines))


@pytest.fixture
def two_schemas(database_url: str, run_id: str) -> Iterator[tuple[str, str]]:
    names = (f"od_{run_id}_migrated", f"od_{run_id}_schema_sql")
    yield names
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.mark.skipif(shutil.which("pg_dump") is None, reason="needs pg_dump (PostgreSQL's client)")
def test_schema_sql_builds_exactly_what_the_migrations_build(
    database_url: str, two_schemas: tuple[str, str]
) -> None:
    by_migrations, by_file = two_schemas
    migrate(database_url, by_migrations)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{by_file}"')
        conn.execute(SCHEMA_SQL.read_text("utf-8").replace("__SCHEMA__", f'"{by_file}"').encode())
    built, written = _catalog(database_url, by_migrations), _catalog(database_url, by_file)
    assert "CREATE TABLE __SCHEMA__.outbox (" in built
    assert written == built, "sql/schema.sql differs from the migrations: update it"
