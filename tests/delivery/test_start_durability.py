"""Delivery starts that do not wait for the disk, and the state a Postgres crash leaves.

By default a start commits without waiting for its WAL flush and the claim before it waits
instead (``policy.starts_flushed``). A crash of Postgres may then lose a start whose handler
ran: the row is left claimed, not started, by a claim older than the server's start. What
the crash leaves is plain row state, so these tests write it (no crash needed) and check that
every path takes such an attempt as one that may have run. The chaos suite
(``faults/test_chaos.py``) kills Postgres for real and requires every duplicate effect to
be flagged ``maybe_applied``."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox_dispatch import Context, Dispatcher, Outcome
from outbox_dispatch.store import Store

pytestmark = pytest.mark.usefixtures("clean")


def _enqueue(dispatcher: Dispatcher, database_url: str, cmd: str) -> int:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return dispatcher.enqueue(conn, cmd, {})


def _claim_one(dispatcher: Dispatcher, family: str) -> uuid.UUID:
    claimed = dispatcher.claimer.claim_family(dispatcher.families[family]).claimed
    assert len(claimed) == 1
    return claimed[0].token


def _crash_lost_the_start(database_url: str, schema: str, row_id: int) -> None:
    """The row as a crash that lost its start leaves it: claimed before the server started."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{schema}".outbox SET claimed_at = pg_postmaster_start_time() - '
            "interval '1 second' WHERE id = %s AND claim_token IS NOT NULL AND started_at IS NULL",
            (row_id,),
        )


def _lapse(database_url: str, schema: str, row_id: int) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}".outbox SET due_at = now() WHERE id = %s', (row_id,))


def _row(database_url: str, schema: str, row_id: int) -> dict[str, Any]:
    with psycopg.connect(database_url, row_factory=psycopg.rows.dict_row) as conn:
        row = conn.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert row is not None
    return row


def _flags(seen: list[tuple[int, bool]]) -> Callable[[Context, Any], None]:
    def note(ctx: Context, payload: Any) -> None:
        seen.append((ctx.attempt, ctx.maybe_applied))

    return note


def test_a_start_a_crash_may_have_lost_waits_for_its_lease_and_runs_as_a_lost_attempt(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    seen: list[tuple[int, bool]] = []
    cmd = commands(family="quick", fn=_flags(seen))  # retries lost attempts: starts not flushed
    row_id = _enqueue(dispatcher, database_url, cmd)
    token = _claim_one(dispatcher, "quick")
    _crash_lost_the_start(database_url, dispatcher.schema, row_id)

    # the message that carried the claim (redelivered, or still queued) may not start it: its
    # handler may have run already, and may still be running where its worker survived
    result = dispatcher.delivery.deliver(row_id, token, family_hint="quick")
    assert result.outcome is Outcome.STALE and seen == []
    assert "Postgres last started" in dispatcher.store.why_stale(row_id, token)

    _lapse(database_url, dispatcher.schema, row_id)
    assert dispatcher.drain(timeout=5).delivered == 1
    assert seen == [(2, True)]  # a new attempt, told the one before may have taken effect


def test_a_first_delivery_of_a_claim_older_than_the_server_starts_at_once_unflagged(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A message the broker delivers for the first time was never started under its token: a
    Postgres restart between its claim and its start costs the row nothing (no lease waited,
    no maybe_applied)."""
    seen: list[tuple[int, bool]] = []
    cmd = commands(family="quick", fn=_flags(seen))
    row_id = _enqueue(dispatcher, database_url, cmd)
    token = _claim_one(dispatcher, "quick")
    _crash_lost_the_start(database_url, dispatcher.schema, row_id)
    result = dispatcher.delivery.deliver(row_id, token, family_hint="quick", first_delivery=True)
    assert result.outcome is Outcome.DELIVERED
    assert seen == [(1, False)]


def test_a_claim_older_than_the_server_counts_as_lost_when_it_lapses(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    row_id = _enqueue(dispatcher, database_url, commands(family="quick"))
    _claim_one(dispatcher, "quick")
    _crash_lost_the_start(database_url, dispatcher.schema, row_id)
    _lapse(database_url, dispatcher.schema, row_id)
    assert [c.id for c in dispatcher.claimer.claim_family(dispatcher.families["quick"]).claimed]
    row = _row(database_url, dispatcher.schema, row_id)
    assert (row["attempts"], row["lost_attempts"], row["maybe_applied"]) == (2, 1, True)
    assert row["last_error"] == (
        "attempt 1 ended without an outcome (claimed before Postgres restarted, which may have "
        "lost its start)"
    )


@pytest.mark.parametrize("why", ["the family parks lost attempts", "flushed_starts=True"])
def test_where_starts_flush_an_older_claim_is_certain_and_costs_nothing(
    why: str,
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flushed start cannot be lost, so a claim older than the server's start never started:
    a Postgres restart must not count it lost (a family that parks lost attempts would park
    rows that never ran)."""
    if why == "flushed_starts=True":
        family = "quick"
        monkeypatch.setattr(dispatcher.store, "flushed_starts", True)
    else:
        family = "parklost"
        dispatcher.family(family, lease=5, on_lost="park")
    seen: list[tuple[int, bool]] = []
    cmd = commands(family=family, fn=_flags(seen))
    first, second = (_enqueue(dispatcher, database_url, cmd) for _ in range(2))
    claimed = dispatcher.claimer.claim_family(dispatcher.families[family]).claimed
    assert sorted(c.id for c in claimed) == [first, second]
    for row_id in (first, second):
        _crash_lost_the_start(database_url, dispatcher.schema, row_id)

    token = next(c.token for c in claimed if c.id == first)
    assert dispatcher.delivery.deliver(first, token, family_hint=family).outcome is (
        Outcome.DELIVERED
    )
    _lapse(database_url, dispatcher.schema, second)
    again = dispatcher.claimer.claim_family(dispatcher.families[family]).claimed
    assert [c.id for c in again] == [second]
    row = _row(database_url, dispatcher.schema, second)
    assert (row["attempts"], row["lost_attempts"], row["maybe_applied"]) == (1, 0, False)
    assert row["parked_at"] is None
    assert dispatcher.delivery.deliver(second, again[0].token, family_hint=family).outcome is (
        Outcome.DELIVERED
    )
    assert seen == [(1, False), (1, False)]


def test_a_row_set_waiting_keeps_a_start_a_crash_may_have_lost(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A capped claim sets rows of actors at their cap waiting and ends the lapsed claims they
    carry: an attempt that never started is given back, but one whose claim is older than the
    server's start may have run, and stays counted and started (its next claim counts it
    lost)."""
    cmd = commands(family="quick")
    maybe, certain = (_enqueue(dispatcher, database_url, cmd) for _ in range(2))
    dispatcher.claimer.claim_family(dispatcher.families["quick"])
    for row_id in (maybe, certain):
        _crash_lost_the_start(database_url, dispatcher.schema, row_id)
    with psycopg.connect(database_url, autocommit=True) as conn:
        for row_id, flushed in ((maybe, False), (certain, True)):
            conn.execute(
                dispatcher.store.q["claim_mark_waiting"],
                {"ids": [row_id], "lease": 5, "flushed_starts": flushed},
            )
    kept, given_back = (_row(database_url, dispatcher.schema, i) for i in (maybe, certain))
    assert kept["attempts"] == 1 and kept["started_at"] is not None and kept["waiting"]
    assert given_back["attempts"] == 0 and given_back["started_at"] is None
    assert kept["claim_token"] is None and given_back["claim_token"] is None


@pytest.mark.parametrize("server", ["on", "remote_apply", "off"])
@pytest.mark.parametrize("flushed", [False, True])
def test_either_the_claim_or_the_start_waits_for_the_flush(
    flushed: bool, server: str, dispatcher: Dispatcher, database_url: str
) -> None:
    """The claim's transaction and the start's statement set synchronous_commit for
    themselves: exactly one of the two waits for the disk, whichever the family's starts say,
    as the session says (so a synchronous standby is waited for too), or locally where the
    session's setting (a server's default) flushes nothing."""
    with psycopg.connect(database_url, options=f"-c synchronous_commit={server}") as conn:
        default = "local" if server == "off" else server
        conn.execute(
            dispatcher.store.q["claim_lock_family"],
            {"lock_name": f"test.{uuid.uuid4()}", "flushed_starts": flushed},
        )
        claim = conn.execute("SHOW synchronous_commit").fetchone()
        conn.rollback()
        conn.execute(
            dispatcher.store.q["deliver_begin"],
            {
                "id": 0,
                "token": uuid.uuid4(),
                "run_lease": 5,
                "deleted": 0,
                "deleted_token": uuid.uuid4(),
                "done": 0,
                "done_token": uuid.uuid4(),
                "flushed": flushed,
                "first_delivery": False,
            },
        )
        start = conn.execute("SHOW synchronous_commit").fetchone()
        conn.rollback()
    assert claim is not None and start is not None
    assert (claim[0], start[0]) == (("off", default) if flushed else (default, "off"))


@pytest.mark.parametrize("server", ["on", "remote_apply", "off"])
def test_settles_wait_for_the_disk_even_where_the_servers_default_flushes_nothing(
    server: str, dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """Retry, park, cancel and ordered settles commit on the pool, whose sessions wait for the
    disk as the server's default says, or locally where it says ``off`` (a settle lost in a
    crash would run its row again). The deferred settles of delivered rows still opt out for
    their own transaction, and a transactional handler's transaction, on a connection of the
    same pool, commits as the user's setting says (its effects and its settle are lost
    together or not at all); the session's setting is back after either."""
    url = make_conninfo(database_url, options=f"-c synchronous_commit={server}")
    store = Store(url, dispatcher.schema, pool_size=1, handler_pool_size=0)  # one session
    row_id = _enqueue(dispatcher, database_url, commands(family="quick"))
    token = _claim_one(dispatcher, "quick")
    try:
        with store.connection() as conn:
            session = conn.execute("SHOW synchronous_commit").fetchone()
            with conn.transaction():
                conn.execute(store.q["settle_without_flush"])
                deferred = conn.execute("SHOW synchronous_commit").fetchone()
            after = conn.execute("SHOW synchronous_commit").fetchone()
        with store.handler_transaction(row_id, token) as held:
            assert held is not None
            handler = held[0].execute("SHOW synchronous_commit").fetchone()
        with store.connection() as conn:
            later = conn.execute("SHOW synchronous_commit").fetchone()
    finally:
        store.close()
    flushed = "local" if server == "off" else server
    assert (session, deferred, after) == ((flushed,), ("off",), (flushed,))
    assert (handler, later) == ((server,), (flushed,))
