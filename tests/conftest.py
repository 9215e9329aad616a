"""Shared fixtures: one fresh Postgres schema and one Redis key prefix per test session, so
runs never see each other's rows or messages. The in-process fixtures (tests/fixtures/inprocess.py)
and the process fixtures (tests/fixtures/processes.py) are plugins, loaded here for every
folder."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis

from outbox_dispatch.store.migrations import migrate

# helpers outside the test modules (tests/support/, the model's machine and invariants) get
# pytest's assertion messages too; registered before anything imports them
pytest.register_assert_rewrite("tests.support", "tests.model")

pytest_plugins = ["tests.fixtures.inprocess", "tests.fixtures.processes"]

DATABASE_URL = os.environ.get(
    "OUTBOX_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def database_url() -> str:
    return DATABASE_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def schema(database_url: str, run_id: str) -> Iterator[str]:
    name = f"od_test_{run_id}"
    migrate(database_url, name)
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture(scope="session")
def key_prefix(redis_url: str, run_id: str) -> Iterator[str]:
    prefix = f"od_test_{run_id}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def drop_run(database_url: str, schema: str, redis_url: str, prefix: str) -> None:
    """What a test run made: its schema and its Redis keys."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def count_rows(database_url: str, schema: str, where: str = "TRUE") -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE {where}').fetchone()
    assert row is not None
    return int(row[0])
