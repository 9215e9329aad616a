"""Values at the edge of their type (issue 12's review), against the real Postgres: an enormous
delay, a retention out of range and intervals past what Postgres can add are refused, and the
caller's transaction stays usable."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Dispatcher, InvalidArgument, Message, OutboxError
from tests.conftest import count_rows
from tests.support.review import (
    _handler,
    _name,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


# -- 8. values at the edge of their type -------------------------------------------------------


@pytest.mark.parametrize(
    "delay", [timedelta(days=10**6), timedelta.max, timedelta(days=100 * 366, seconds=1)]
)
def test_an_enormous_delay_is_refused_and_the_callers_transaction_stays_usable(
    d: Dispatcher, database_url: str, schema: str, delay: timedelta
) -> None:
    cmd = _handler(d, "intent", lambda ctx, p: None)
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(InvalidArgument, match="delay must be at most"):
            d.enqueue(conn, cmd, {}, delay=delay)
        with pytest.raises(InvalidArgument, match="delay must be at most"):
            d.enqueue_many(conn, [Message(cmd, {}, delay=delay)])
        assert conn.execute("SELECT 1").fetchone() == (1,)
        d.enqueue(conn, cmd, {}, delay=timedelta(days=100 * 365))  # the longest allowed works
    assert count_rows(database_url, schema) == 1


@pytest.mark.parametrize("bad", [math.nan, -1.0, 1e300, timedelta(days=-1)])
def test_a_retention_out_of_range_is_refused_when_the_family_is_declared(
    d: Dispatcher, bad: float | timedelta
) -> None:
    with pytest.raises(OutboxError, match="retention"):
        d.family(_name("badkeep"), retention=bad)


@pytest.mark.parametrize(
    "option", [{"lease": 1e300}, {"lease": math.nan}, {"time_limit": 1e300}, {"lease": 0.5}]
)
def test_intervals_past_what_postgres_can_add_are_refused_at_declaration(
    d: Dispatcher, option: dict[str, Any]
) -> None:
    with pytest.raises(OutboxError):
        d.family(_name("badlease"), **option)
