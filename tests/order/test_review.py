"""Ordered families and isolation levels (issue 12's review), against the real Postgres: an
ordered enqueue under snapshot isolation is refused before anything is written, one at read
committed waits behind the other producer's head, and rows blocked in a family that is no
longer ordered become due."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import IsolationLevel

from outbox_dispatch import Dispatcher, Message, OutboxError
from tests.conftest import count_rows
from tests.support.review import (
    _claim,
    _enqueue,
    _handler,
    _name,
    review_dispatcher,  # noqa: F401 (the fixture d)
)

pytestmark = pytest.mark.usefixtures("clean")


# -- 3. ordered families and snapshot isolation ------------------------------------------------


@pytest.mark.parametrize("level", [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE])
@pytest.mark.parametrize("way", ["enqueue", "enqueue_many", "cancel"])
def test_ordered_rows_under_snapshot_isolation_are_refused_before_anything_is_written(
    d: Dispatcher, database_url: str, schema: str, level: IsolationLevel, way: str
) -> None:
    """Under REPEATABLE READ the caller's snapshot predates the other producer's commit, so
    its head check would see no head and make a second one: refused, with the transaction
    still usable."""
    fam = _name("iso")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    before = _enqueue(d, database_url, [Message(cmd, {}, actor="X")])[0] if way == "cancel" else 0
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = level
        with conn.transaction():
            conn.execute("SELECT 1")  # the snapshot is taken here
            if way != "cancel":  # another producer commits the actor's head after it
                _enqueue(d, database_url, [Message(cmd, {}, actor="X")])
            with pytest.raises(OutboxError, match="READ COMMITTED"):
                if way == "enqueue":
                    d.enqueue(conn, cmd, {}, actor="X")
                elif way == "enqueue_many":
                    d.enqueue_many(conn, [Message(cmd, {}, actor="X")])
                else:
                    d.cancel(conn, before)
            assert conn.execute("SELECT 2").fetchone() == (2,)  # still usable
    heads = count_rows(database_url, schema, f"family = '{fam}' AND NOT blocked")
    assert heads == 1
    assert count_rows(database_url, schema, f"family = '{fam}' AND cancelled_at IS NULL") == 1


def test_ordered_enqueue_at_read_committed_still_waits_behind_the_other_producers_head(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("rc")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        with conn.transaction():
            conn.execute("SELECT 1")
            _enqueue(d, database_url, [Message(cmd, {}, actor="X")])
            d.enqueue(conn, cmd, {}, actor="X")
    assert count_rows(database_url, schema, f"family = '{fam}' AND NOT blocked") == 1
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 1


def test_rows_blocked_in_a_family_that_is_no_longer_ordered_become_due(
    d: Dispatcher, database_url: str, schema: str
) -> None:
    fam = _name("wasline")
    d.family(fam, ordered=True)
    cmd = _handler(d, fam, lambda ctx, p: None)
    ids = _enqueue(d, database_url, [Message(cmd, {}, actor="U")] * 3)
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 2
    d.family(fam)  # redeclared without ordering
    d.ops.prune()
    assert count_rows(database_url, schema, f"family = '{fam}' AND blocked") == 0
    assert sorted(c.id for c in _claim(d, fam)) == ids
