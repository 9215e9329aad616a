"""The pytest plugin, as a user's test suite runs it (pytester)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import psycopg
import pytest

from outbox_dispatch.store.migrations import migrate

USER_APP = """
from celery import Celery
from outbox_dispatch import Dispatcher

SEEN = []
app = Celery("userapp", broker="memory://", set_as_current=False)
dispatcher = Dispatcher(app, database_url="{url}", schema="{schema}")

@dispatcher.handler("user.hello")
def hello(ctx, payload):
    SEEN.append(payload["n"])
"""

USER_TESTS = """
import time
import psycopg
import userapp

URL = "{url}"

def test_drain_delivers_what_the_test_committed(outbox_drain):
    with psycopg.connect(URL) as conn, conn.transaction():
        userapp.dispatcher.enqueue(conn, "user.hello", {{"n": 1}})
    report = outbox_drain()
    assert report.delivered == 1
    assert userapp.SEEN == [1]

def test_inline_delivers_right_after_commit(outbox_inline):
    userapp.SEEN.clear()
    with psycopg.connect(URL) as conn, conn.transaction():
        userapp.dispatcher.enqueue(conn, "user.hello", {{"n": 2}})
    deadline = time.monotonic() + 5
    while userapp.SEEN != [2]:  # no drain here: the commit's NOTIFY delivers it
        assert time.monotonic() < deadline, "not delivered inline"
        time.sleep(0.02)
    with psycopg.connect(URL) as conn, conn.transaction():  # the listener still listens
        userapp.dispatcher.enqueue(conn, "user.hello", {{"n": 3}})
    while userapp.SEEN != [2, 3]:
        assert time.monotonic() < deadline, "second commit not delivered inline"
        time.sleep(0.02)
    assert outbox_inline.wait().delivered == 0
"""


@pytest.fixture
def user_schema(database_url: str, run_id: str) -> Iterator[str]:
    name = f"od_plugin_{run_id}_{random.randrange(10**6)}"
    migrate(database_url, name)
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_plugin_fixtures_in_a_users_suite(
    pytester: pytest.Pytester, database_url: str, user_schema: str
) -> None:
    pytester.makepyfile(userapp=USER_APP.format(url=database_url, schema=user_schema))
    pytester.makepyfile(test_user=USER_TESTS.format(url=database_url))
    result = pytester.runpytest_subprocess(
        "--outbox-app", "userapp:dispatcher", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
