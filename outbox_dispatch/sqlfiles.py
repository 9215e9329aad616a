"""Loads the SQL that lives in files next to this module: named queries and migrations."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .naming import quoted

SCHEMA_TOKEN = "__SCHEMA__"  # noqa: S105 (a placeholder, not a secret)
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def _read(*parts: str) -> str:
    return resources.files("outbox_dispatch").joinpath("sql", *parts).read_text("utf-8")


@cache
def raw_queries() -> dict[str, str]:
    """The blocks of queries.sql keyed by their ``-- name:`` line."""
    text = _read("queries.sql")
    matches = list(_NAME.finditer(text))
    queries: dict[str, str] = {}
    for here, nxt in zip(matches, [*matches[1:], None], strict=True):
        end = nxt.start() if nxt else len(text)
        body = text[here.end() : end].strip()
        queries[here.group(1)] = body.rstrip(";").strip()
    return queries


_CLOCK = re.compile(r"\b(now|clock_timestamp)\(\)")


def queries_for(schema: str, clock_offset: float = 0.0) -> dict[str, str]:
    """The named queries for ``schema``. A ``clock_offset`` (tests only) moves every clock the
    queries read by that many seconds, so a test can let leases run out without sleeping."""
    target = quoted(schema)
    queries = {name: body.replace(SCHEMA_TOKEN, target) for name, body in raw_queries().items()}
    if clock_offset:
        shift = f"interval '{float(clock_offset)!r} seconds'"
        queries = {name: _CLOCK.sub(rf"(\1() + {shift})", q) for name, q in queries.items()}
    return queries


@cache
def migrations() -> tuple[Migration, ...]:
    folder = resources.files("outbox_dispatch").joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(
            f"migration files must be numbered 0001, 0002, ... without gaps: {versions}"
        )
    return tuple(found)


def migration_sql(migration: Migration, schema: str) -> str:
    return migration.text.replace(SCHEMA_TOKEN, quoted(schema))
