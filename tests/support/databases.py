"""Fixtures of the several-databases tests: the session's database and two made for this run
(``od_mdb_<run>_<n>``), each with the session's outbox schema, and a factory of Dispatchers
over them. Registered for every folder through tests/fixtures/inprocess.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Dispatcher
from outbox_dispatch.store.migrations import migrate


def url_of(database_url: str, name: str) -> str:
    return database_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def shard_urls(database_url: str, schema: str, run_id: str) -> Iterator[dict[str, str]]:
    """main (the session's database) and two databases made for this run."""
    names = [f"od_mdb_{run_id}_{n}" for n in (1, 2)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
    urls = {"main": database_url, "eu": url_of(database_url, names[0])}
    urls["us"] = url_of(database_url, names[1])
    for url in list(urls.values())[1:]:
        migrate(url, schema)
    yield urls
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_dispatcher(
    shard_urls: dict[str, str], redis_url: str, schema: str, key_prefix: str
) -> Iterator[Callable[..., Dispatcher]]:
    """A Dispatcher over the shards on a Redis prefix of its own, every outbox emptied."""
    made: list[Dispatcher] = []

    def build(urls: dict[str, str] | None = None, **kwargs: Any) -> Dispatcher:
        app = Celery("mdb", broker=redis_url, set_as_current=False)
        prefix = f"{key_prefix}mdb{uuid.uuid4().hex[:6]}:"
        app.conf.broker_transport_options = {"global_keyprefix": prefix}
        app.conf.worker_hijack_root_logger = False
        options: dict[str, Any] = {"listen": False, **kwargs}
        d = Dispatcher(
            app,
            databases=urls or shard_urls,
            redis_url=redis_url,
            schema=schema,
            key_prefix=prefix.rstrip(":"),
            **options,
        )
        made.append(d)
        return d

    for url in shard_urls.values():
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'TRUNCATE "{schema}".outbox')
    yield build
    for d in made:
        d.close()
