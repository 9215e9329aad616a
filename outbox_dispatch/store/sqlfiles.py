"""Loads the SQL that lives in files next to this module: named queries and migrations."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from outbox_dispatch.core.naming import quoted

SCHEMA_TOKEN = "__SCHEMA__"  # noqa: S105 (a placeholder, not a secret)
_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


@cache
def raw_queries() -> dict[str, str]:
    """Every named query of sql/*.sql (one file per concern: enqueue, claim, deliver, settle,
    cancel, caps, ordered, maintenance, status, runstats, session), keyed by its ``-- name:``
    line; schema.sql names none."""
    folder = resources.files("outbox_dispatch").joinpath("sql")
    queries: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, body in _named_blocks(entry.read_text("utf-8")):
            if name in queries:
                raise RuntimeError(f"query {name!r} is named twice in sql/ (again in {entry.name})")
            queries[name] = body
    return queries


def _named_blocks(text: str) -> list[tuple[str, str]]:
    """The ``-- name:`` blocks of one file; what comes before the first is the file's header."""
    matches = list(_NAME.finditer(text))
    if not matches:  # schema.sql: the whole schema, no named query
        return []
    blocks = []
    for here, nxt in zip(matches, [*matches[1:], None], strict=True):
        end = nxt.start() if nxt else len(text)
        blocks.append((here.group(1), text[here.end() : end].strip().rstrip(";").strip()))
    return blocks


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
