"""What the store does when Postgres ends its connections: a pooled connection the server ended
is found without a statement failing on it; errors that say the server is gone are told from
errors of the statement itself; a fenced statement waits for the database's return, and an
outage is said once."""

from __future__ import annotations

import logging

import psycopg
import pytest
from psycopg_pool import PoolTimeout

from outbox_dispatch import Dispatcher
from outbox_dispatch.core.errors import DatabaseUnavailable
from outbox_dispatch.store import Store
from outbox_dispatch.store.connections import hung_up, unreachable
from outbox_dispatch.store.health import RETRY_MOST, Outage, when_answering


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_pooled_connection_the_server_ended_is_replaced_before_a_statement_meets_it(
    dispatcher: Dispatcher, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(database_url, dispatcher.schema, pool_size=1)  # one connection: the one ended
    try:
        with store.connection() as conn:
            pid = conn.info.backend_pid
            assert not hung_up(conn)
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))  # waits for its end
        with caplog.at_level(logging.INFO):
            with store.connection() as conn:  # the pool would give back the ended one
                assert conn.execute("SELECT 1").fetchone() == (1,)
                assert conn.info.backend_pid != pid
            with store.connection() as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store.close()
    said = [r for r in caplog.records if getattr(r, "action", None) == "database_unreachable"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    back = [r for r in caplog.records if getattr(r, "action", None) == "database_back"]
    assert len(back) == 1 and back[0].levelno == logging.INFO


def test_a_closed_connection_is_hung_up(database_url: str) -> None:
    conn = psycopg.connect(database_url)
    conn.close()
    assert hung_up(conn)


@pytest.mark.parametrize(
    ("error", "gone"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (PoolTimeout("couldn't get a connection after 30.00 sec"), True),
        (psycopg.errors.AdminShutdown("terminating connection"), True),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), True),
        (psycopg.errors.ConnectionFailure("connection failure"), True),
        (psycopg.errors.DiskFull("no space left"), False),
        (psycopg.errors.QueryCanceled("canceling statement"), False),
        (psycopg.errors.UniqueViolation("duplicate key"), False),
    ],
)
def test_errors_that_say_the_server_is_gone_are_told_from_the_statements_own(
    error: Exception, gone: bool
) -> None:
    assert unreachable(error) is gone


def test_a_fenced_statement_waits_for_the_database_and_the_outage_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = Outage("default", clock)
    failures = iter(range(4))

    def start() -> str:
        if next(failures, None) is not None:
            raise DatabaseUnavailable("delivery start: the database is not answering")
        return "started"

    with caplog.at_level(logging.DEBUG):
        assert when_answering(start, outage, "delivery start", sleep=clock.sleep) == "started"
        outage.answered()
    levels = [r.levelno for r in caplog.records if getattr(r, "action", None)]
    assert levels == [logging.WARNING] + [logging.DEBUG] * 3 + [logging.INFO]
    assert clock.now <= 0.25 + 0.5 + 2 * RETRY_MOST  # the waits grow, to the most


def test_a_fenced_statement_gives_up_after_its_patience_and_a_known_outage_at_once() -> None:
    clock = Clock()
    outage = Outage("default", clock)

    def down() -> None:
        raise DatabaseUnavailable("not answering")

    with pytest.raises(DatabaseUnavailable):
        when_answering(down, outage, "settle", patience=10, sleep=clock.sleep)
    assert 9 <= clock.now <= 10

    def known() -> None:
        raise DatabaseUnavailable("breaker open", repeated=True)

    clock.now = 0.0
    with pytest.raises(DatabaseUnavailable):
        when_answering(known, outage, "start", sleep=clock.sleep)
    assert clock.now == 0.0
