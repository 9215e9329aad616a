"""Settings a user's Postgres may have by default (in postgresql.conf, on the role, or in the
URL's options) that the outbox's own sessions must not inherit: the main pool sets what its
statements rely on for each new connection (pool.py, session.sql)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Context, DatabaseError, Dispatcher, PermanentFailure
from outbox_dispatch.claim.claimer import ClaimReport
from outbox_dispatch.core.settle import Outcome
from tests.fixtures.inprocess import dispatcher_under

pytestmark = pytest.mark.usefixtures("clean")

CLAIM_LOCK = "SELECT pg_advisory_xact_lock(hashtext(%s))"
CAPS_LOCK = "SELECT pg_advisory_xact_lock{}(hashtextextended(%s, 0))"  # "" or "_shared"
STYLES = "-c DateStyle=SQL,\\ DMY -c IntervalStyle=iso_8601 -c TimeZone=Pacific/Chatham"


@pytest.fixture
def styled(database_url: str, redis_url: str) -> Iterator[tuple[Dispatcher, str]]:
    """Sessions that default to dates as 'SQL, DMY' (04/12/2026 18:20:37 UTC) and intervals
    as ISO 8601 (PT1S), neither of which psycopg parses, in a time zone 13:45 ahead of UTC."""
    with dispatcher_under(STYLES, database_url, redis_url, "styles") as made:
        yield made


def test_a_server_with_other_date_and_interval_styles_delivers_parks_and_shows_its_rows(
    styled: tuple[Dispatcher, str],
) -> None:
    d, url = styled
    with psycopg.connect(url) as plain:  # the URL's defaults, as a user's server could set them
        row = plain.execute("SHOW DateStyle").fetchone()
        assert row is not None and row[0] == "SQL, DMY"
        with pytest.raises(NotImplementedError, match="can't parse"):
            plain.execute("SELECT now()").fetchone()
    d.family("plain", max_attempts=1, lease=5)
    d.family("capped", per_actor=1, lease=5)
    ran: list[int] = []

    def ok(ctx: Context, payload: Any) -> None:
        ran.append(ctx.row_id)

    def broken(ctx: Context, payload: Any) -> None:
        raise PermanentFailure("cannot be done")

    d.handler("s.ok", family="plain")(ok)
    d.handler("s.cap", family="capped")(ok)
    d.handler("s.broken", family="plain")(broken)
    d.migrate()
    with psycopg.connect(url) as conn, conn.transaction():
        good = d.enqueue(conn, "s.ok", {})
        capped = d.enqueue(conn, "s.cap", {}, actor="a")
        bad = d.enqueue(conn, "s.broken", {})
    report = d.drain(timeout=20)
    assert report.delivered == 2 and report.count(Outcome.PARKED) == 1
    assert sorted(ran) == sorted([good, capped])
    assert {s.family: s.parked for s in d.ops.status()}["plain"] == 1
    [parked] = d.store.parked_list()
    assert parked["id"] == bad and parked["parked_at"] >= parked["created_at"]
    assert d.ops.parked_purge(family="plain") == [bad]

    with psycopg.connect(url) as conn, conn.transaction():  # a delayed row, cancelled
        later = d.enqueue(conn, "s.ok", {}, delay=timedelta(minutes=5))
        assert d.cancel(conn, later, reason="styles").cancelled == [later]
    d.ops.cron("styles", "* * * * * *", "s.ok", {"kind": "cron"}, catch_up="latest")
    assert d.ops.run_cron() == {}  # creates the schedule's row
    time.sleep(1.1)
    assert d.ops.run_cron() == {"styles": 1}  # reads and writes the schedule's times
    assert d.drain(timeout=20).delivered == 1


def test_a_server_that_ends_idle_sessions_ends_none_of_ours(
    database_url: str, redis_url: str
) -> None:
    """A server with idle_session_timeout (Postgres 14 and later) ends a session idle for
    that long: the pool's connections between statements, and the listener's between
    notifications. Ours opt out, so a claim, a start and a settle after a pause (a
    transactional handler's too), and a commit's NOTIFY after a quiet spell, all find their
    sessions alive."""
    with dispatcher_under("-c idle_session_timeout=300", database_url, redis_url, "idle") as (
        d,
        url,
    ):
        with psycopg.connect(url) as plain:
            row = plain.execute("SHOW idle_session_timeout").fetchone()
            assert row is not None and row[0] == "300ms"
        d.family("plain", lease=5)
        ran: list[int] = []
        d.handler("i.ok", family="plain")(lambda ctx, payload: ran.append(ctx.row_id))

        def in_txn(ctx: Context, payload: Any) -> None:  # on the handlers' pool
            assert ctx.conn is not None
            ctx.conn.execute("SELECT 1")
            ran.append(ctx.row_id)

        d.handler("i.txn", family="plain", transactional=True)(in_txn)
        d.migrate()
        for _ in range(3):  # each round after the server would have ended an idle session
            with psycopg.connect(database_url) as conn, conn.transaction():
                d.enqueue(conn, "i.ok", {})
                d.enqueue(conn, "i.txn", {})
            assert d.drain(timeout=10).delivered == 2
            time.sleep(0.5)
        assert len(ran) == 6

        woke = threading.Event()

        def woken(families: list[str] | None) -> ClaimReport:
            if families is not None:
                woke.set()
            return ClaimReport()

        listener = d.runtime.commit_listener()
        listener.sweep = None
        listener.claim = woken
        listener.start()
        try:
            assert listener.leading.wait(10)
            time.sleep(0.8)  # quiet: idle past the server's timeout
            with psycopg.connect(database_url) as conn, conn.transaction():
                d.enqueue(conn, "i.ok", {})
            assert woke.wait(5), "the listener's session was ended while it waited"
        finally:
            listener.stop()


def test_a_transactional_handler_outlasting_a_heartbeat_commits_under_a_repeatable_read_default(
    database_url: str, redis_url: str
) -> None:
    """The heartbeat renews a running row's lease from another connection while a
    transactional handler runs; the handler's transaction then settles that row. Under a
    REPEATABLE READ default that settle could not serialize with the renewal: every attempt
    longer than a renewal was rolled back and retried. The handler's transaction reads
    committed, whatever the default."""
    rr = "-c default_transaction_isolation=repeatable\\ read"
    with dispatcher_under(rr, database_url, redis_url, "rr") as (d, _):
        # a heartbeat timeout of 2 s: renewals every 0.67 s, each with 1.3 s to spare (with 1 s,
        # a CI run with the machine loaded by other work once saw the lease run out first)
        d.family("slow", max_attempts=1, lease=10, heartbeat_timeout=2.0)
        seen: list[str] = []

        def slow(ctx: Context, payload: Any) -> None:
            assert ctx.conn is not None
            row = ctx.conn.execute("SHOW transaction_isolation").fetchone()
            seen.append(row[0] if row else "")
            time.sleep(1.0)  # past a renewal (every third of the heartbeat timeout)

        d.handler("rr.slow", family="slow", transactional=True)(slow)
        d.migrate()
        with psycopg.connect(database_url) as conn, conn.transaction():
            d.enqueue(conn, "rr.slow", {})
        report = d.drain(timeout=20)
        assert report.delivered == 1, report
        assert seen == ["read committed"]


def _quick_family(d: Dispatcher, command: str, lease: float) -> list[int]:
    """Family "quick" with a handler for ``command`` that notes the rows it runs, migrated;
    returns that note."""
    ran: list[int] = []
    d.family("quick", lease=lease)
    d.handler(command, family="quick")(lambda ctx, payload: ran.append(ctx.row_id))
    d.migrate()
    return ran


def _hold_lock(database_url: str, take: str, lock_name: str, seconds: float) -> threading.Thread:
    """Another session holding an advisory lock (``take`` its statement, given the name) for
    ``seconds``, as a long claim or a rebuild does; started, and returned once it holds it."""
    held = threading.Event()

    def hold() -> None:
        with psycopg.connect(database_url) as conn, conn.transaction():
            conn.execute(take, (lock_name,))
            held.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    return holder


def _hold_claim_lock(database_url: str, lock_name: str, seconds: float) -> threading.Thread:
    """A family's claim lock, held as a claim of the family holds it."""
    return _hold_lock(database_url, CLAIM_LOCK, lock_name, seconds)


def test_a_claim_waits_out_another_claim_of_its_family_under_a_short_lock_timeout(
    database_url: str, redis_url: str
) -> None:
    """A server or role with a short ``lock_timeout`` (against pile-ups behind DDL): a claim
    that waits for another claim of its family (which holds the family's claim lock while it
    runs) waits it out and claims, where the timeout used to fail the claim."""
    with dispatcher_under("-c lock_timeout=100", database_url, redis_url, "locks") as (d, url):
        _quick_family(d, "t.locks", lease=5)
        with psycopg.connect(url) as conn, conn.transaction():
            row_id = d.enqueue(conn, "t.locks", {})
        holder = _hold_claim_lock(database_url, f"{d.schema}.claim.quick", 0.4)  # 4 timeouts
        t0 = time.monotonic()
        published: list[Any] = []
        try:
            report = d.claimer.run(lambda family, rows, size: published.extend(rows))
            waited = time.monotonic() - t0
        finally:
            holder.join()
        assert report.claimed == {"quick": 1} and [r.id for r in published] == [row_id]
        assert waited >= 0.3  # it did wait for the other claim's lock
        with psycopg.connect(url) as conn:
            row = conn.execute("SHOW lock_timeout").fetchone()
        assert row is not None and row[0] == "100ms"  # the server's default, as the test set it


def test_a_claim_pass_goes_on_past_a_family_whose_claim_the_server_cancels(
    database_url: str, redis_url: str
) -> None:
    """A ``statement_timeout`` that ends one family's claim (here: while it waits for another
    claim of that family) costs that family this pass, with a warning that says what to do;
    the pass claims the other families, where the error used to end it. The family's next
    claims take half the batch, then grow back, so that a claim longer than the timeout does
    not stop the family for good."""
    with dispatcher_under(
        "-c statement_timeout=200", database_url, redis_url, "cut", claim_batch=8
    ) as (d, url):
        for name in ("held", "free"):
            d.family(name, lease=5)
            d.handler(f"t.{name}", family=name)(lambda ctx, payload: None)
        d.migrate()
        with psycopg.connect(url) as conn, conn.transaction():
            held_ids = [d.enqueue(conn, "t.held", {"i": i}) for i in range(13)]
            free_id = d.enqueue(conn, "t.free", {})
        holder = _hold_claim_lock(database_url, f"{d.schema}.claim.held", 0.6)
        published: list[Any] = []

        def run() -> dict[str, int]:
            return d.claimer.run(lambda family, rows, size: published.extend(rows)).claimed

        try:
            cancelled = run()
        finally:
            holder.join()
        assert cancelled == {"free": 1} and [r.id for r in published] == [free_id]
        # half the batch after the cancellation; then the whole batch again (8 rows, and the
        # pass claims a family that filled its batch once more: the last row)
        assert [run(), run()] == [{"held": 4}, {"held": 9}]
        assert sorted(r.id for r in published[1:]) == held_ids


def test_a_start_the_server_cancels_costs_its_batch_only_that_row(
    database_url: str, redis_url: str
) -> None:
    """A row of a batched message whose start waits past the server's ``lock_timeout`` (a
    session of the application holds the row locked) is left claimed, not started, for its
    lease to bring back; the rows after it in the message still run now, where the
    cancellation used to drop them all until their lease ran out (and a message of that row
    alone failed its Celery task)."""
    with dispatcher_under("-c lock_timeout=100", database_url, redis_url, "rowlock") as (d, url):
        ran = _quick_family(d, "t.rowlock", lease=30)
        with psycopg.connect(url) as conn, conn.transaction():
            ids = [d.enqueue(conn, "t.rowlock", {"i": i}) for i in range(3)]
        claimed = {c.id: c.token for c in d.claimer.claim_family(d.families["quick"]).claimed}
        pairs = [(i, claimed[i]) for i in ids]
        with psycopg.connect(database_url) as app, app.transaction():
            app.execute(f'SELECT 1 FROM "{d.schema}".outbox WHERE id = %s FOR UPDATE', (ids[1],))
            results = d.delivery.deliver_batch(pairs, family_hint="quick")
            alone = d.delivery.deliver_message((ids[1], str(claimed[ids[1]])), family_hint="quick")
        assert [r.outcome for r in results] == [Outcome.DELIVERED, Outcome.STALE, Outcome.DELIVERED]
        assert [r.outcome for r in alone] == [Outcome.STALE]  # a message of its own: the same
        assert ran == [ids[0], ids[2]]
        with psycopg.connect(url) as conn:
            row = conn.execute(
                f'SELECT claim_token, started_at FROM "{d.schema}".outbox WHERE id = %s',
                (ids[1],),
            ).fetchone()
        assert row == (claimed[ids[1]], None)  # still claimed, never started: its lease decides


def test_capped_claims_and_a_caps_rebuild_wait_for_each_other_under_a_short_lock_timeout(
    database_url: str, redis_url: str
) -> None:
    """A capped claim holds the caps lock shared and a rebuild of the semaphores holds it
    exclusively: under a short ``lock_timeout`` each waits out the other (a rebuild timed out
    behind a stream of claims would leave capped rows waiting) instead of failing."""
    with dispatcher_under("-c lock_timeout=100", database_url, redis_url, "capslock") as (d, url):
        d.family("capped", per_actor=2, lease=30)
        d.handler("t.capslock", family="capped")(lambda ctx, payload: None)
        d.migrate()
        with psycopg.connect(url) as conn, conn.transaction():
            row_id = d.enqueue(conn, "t.capslock", {}, actor="A")
        caps_lock = f"{d.schema}.caps"
        holder = _hold_lock(database_url, CAPS_LOCK.format(""), caps_lock, 0.4)  # a rebuild
        try:
            claimed = d.claimer.claim_family(d.families["capped"]).claimed
        finally:
            holder.join()
        assert [c.id for c in claimed] == [row_id]
        holder = _hold_lock(database_url, CAPS_LOCK.format("_shared"), caps_lock, 0.4)  # a claim
        try:
            restored = d.claimer.rebuild_caps()
        finally:
            holder.join()
        assert restored == 1  # the claimed row's slot


def test_a_read_only_default_is_named_with_what_to_do(database_url: str, redis_url: str) -> None:
    """A role (or a standby) whose transactions are read-only by default: the outbox's
    statements fail with an error that says so and what to do, not the bare driver message;
    the rows wait, untouched, for a database that takes writes."""
    with dispatcher_under(
        "-c default_transaction_read_only=on", database_url, redis_url, "readonly"
    ) as (d, url):
        d.family("quick", lease=5)
        d.handler("t.readonly", family="quick")(lambda ctx, payload: None)
        plain = Dispatcher(
            Celery("plain", broker="memory://", set_as_current=False),
            database_url=database_url,
            schema=d.schema,
        )
        plain.family("quick", lease=5)
        plain.handler("t.readonly", family="quick")(lambda ctx, payload: None)
        try:
            plain.migrate()  # through a URL that writes, as a deploy step would
            with psycopg.connect(database_url) as conn, conn.transaction():
                row_id = plain.enqueue(conn, "t.readonly", {})
        finally:
            plain.close()
        with pytest.raises(DatabaseError, match=r"refuses writes.*point the outbox at the primary"):
            d.claimer.run(lambda family, rows, size: None)
        with psycopg.connect(url) as conn:
            row = conn.execute(
                f'SELECT attempts, claim_token FROM "{d.schema}".outbox WHERE id = %s', (row_id,)
            ).fetchone()
        assert row == (0, None)
