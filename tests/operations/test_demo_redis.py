"""The demo clears the queues of an earlier run in its Redis database, and refuses a database
that holds keys it did not make (someone else's), naming them, without touching anything."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import redis

from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.demo.run import _reset


@pytest.fixture
def foreign_key(redis_url: str, run_id: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_url)
    key = f"someone-else:{run_id}"
    client.set(key, "theirs")
    yield key
    client.delete(key)
    client.close()


def test_the_demo_refuses_a_redis_database_holding_keys_it_did_not_make(
    database_url: str, redis_url: str, run_id: str, foreign_key: str
) -> None:
    schema = f"od_demo_{run_id}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        with pytest.raises(ConfigurationError, match="holds keys the demo did not make"):
            _reset(database_url, schema, redis_url)
        client = redis.Redis.from_url(redis_url)
        assert client.get(foreign_key) == b"theirs"  # nothing touched
        client.close()
        with psycopg.connect(database_url, autocommit=True) as conn:  # nor the schema
            found = conn.execute(
                "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)
            ).fetchone()
        assert found is not None
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
