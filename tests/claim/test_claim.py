"""Claims: concurrent claimers never share a row, backpressure, and the claim's query plan."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from outbox_dispatch import Dispatcher
from outbox_dispatch.claim.claimer import Claimer, ClaimReport
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.core.settle import SettleKind
from outbox_dispatch.store import Store
from outbox_dispatch.store.connections import pipelined_transaction
from outbox_dispatch.store.migrations import migrate
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")


def _bulk_insert(database_url: str, schema: str, sql_select: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, actor, payload, due_at, parked_at) '
            + sql_select
        )


def test_two_claimers_racing_claim_each_row_once(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands()
    _bulk_insert(
        database_url,
        dispatcher.schema,
        f"SELECT 'intent', '{cmd}', NULL, '{{}}'::jsonb, now(), NULL FROM generate_series(1, 5000)",
    )
    family = dispatcher.families["intent"].with_policy(max_in_flight=10_000)
    claimed: list[list[int]] = [[], []]
    start = threading.Barrier(2)

    def run(slot: int) -> None:
        store = Store(database_url, dispatcher.schema, pool_size=1)
        start.wait()
        try:
            while True:
                result = store.claim(family, 97)
                if not result.claimed:
                    return
                claimed[slot].extend(c.id for c in result.claimed)
        finally:
            store.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    both = claimed[0] + claimed[1]
    assert len(both) == 5000
    assert len(set(both)) == 5000
    assert claimed[0] and claimed[1], "both claimers should have taken part"
    assert (
        count_rows(database_url, dispatcher.schema, "claim_token IS NOT NULL AND attempts = 1")
        == 5000
    )


def _quick_rows_due(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, n: int
) -> None:
    cmd = commands(family="quick")
    _bulk_insert(
        database_url,
        dispatcher.schema,
        f"SELECT 'quick', '{cmd}', NULL, '{{}}'::jsonb, now(), NULL FROM generate_series(1, {n})",
    )


def test_claim_never_exceeds_max_in_flight(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    _quick_rows_due(dispatcher, commands, database_url, 300)
    family = dispatcher.families["quick"].with_policy(max_in_flight=120)
    first = dispatcher.claimer.claim_family(family, batch=100)
    second = dispatcher.claimer.claim_family(family, batch=100)
    third = dispatcher.claimer.claim_family(family, batch=100)
    assert (len(first.claimed), len(second.claimed), len(third.claimed)) == (100, 20, 0)
    # settling frees capacity again
    for c in first.claimed[:30]:
        assert dispatcher.store.settle(SettleKind.DELETE, c.id, c.token)
    assert len(dispatcher.claimer.claim_family(family, batch=100).claimed) == 30


def test_a_pass_held_back_by_max_in_flight_claims_once_and_says_so(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A family at its in-flight limit is reported saturated (the listener tops it up every
    refill interval) instead of the pass spinning on the few rows each settle frees; only a
    claim that the batch size held back is repeated within the pass."""
    _quick_rows_due(dispatcher, commands, database_url, 300)
    family = dispatcher.families["quick"].with_policy(max_in_flight=40)
    claimer = Claimer(dispatcher.store, {"quick": family}, batch=100)
    published: list[Claimed] = []

    def run() -> ClaimReport:
        return claimer.run(lambda f, rows, size: published.extend(rows), budget=5.0)

    report = run()
    assert (report.claimed, report.rounds, report.saturated) == ({"quick": 40}, 1, {"quick"})
    for c in published[:3]:
        assert dispatcher.store.settle(SettleKind.DELETE, c.id, c.token)
    report = run()
    assert (report.claimed, report.rounds, report.saturated) == ({"quick": 3}, 1, {"quick"})
    # every slot taken and nothing settled: no claim, and saturated, so that the listener
    # tries again within its refill interval instead of leaving the family to beat's next pass
    report = run()
    assert (report.claimed, report.rounds, report.saturated) == ({}, 1, {"quick"})
    # a full broker queue: saturated without asking Postgres (the listener polls its length)
    claimer.queued = lambda f: 40
    report = run()
    assert (report.claimed, report.saturated) == ({}, {"quick"})
    claimer.queued = lambda f: 0
    # with room for all of them, the pass repeats full batches until the due rows run out
    claimer.families = {"quick": family.with_policy(max_in_flight=10_000)}
    report = run()
    assert (report.claimed, report.rounds, report.saturated) == ({"quick": 257}, 3, set())


def test_the_in_flight_count_does_not_use_a_bitmap_scan(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """Settled rows leave dead index entries until vacuum; a bitmap scan reads every one of
    them on every count (seen: 66k entries, 4.5 ms), a plain index scan skips them."""
    store = dispatcher.store
    with psycopg.connect(database_url, autocommit=True) as conn:  # 20k settled claims
        conn.execute(
            f'INSERT INTO "{dispatcher.schema}".outbox (family, command, payload, due_at, '
            "claim_token) SELECT 'intent', 'x', '{}'::jsonb, now(), gen_random_uuid() "
            "FROM generate_series(1, 20000)"
        )
        conn.execute(f"DELETE FROM \"{dispatcher.schema}\".outbox WHERE command = 'x'")
    with store.connection() as conn, conn.transaction():
        conn.execute(
            store.q["claim_lock_family"], {"lock_name": "test.plan", "flushed_starts": False}
        )
        plan = "\n".join(
            str(r[0])
            for r in conn.execute(
                "EXPLAIN " + store.q["claim_capped_candidates"],
                {"family": "intent", "batch": 500, "max_in_flight": 1000},
            ).fetchall()
        )
    assert "Bitmap" not in plan, plan
    assert "Index" in plan, plan


@pytest.fixture(scope="module")
def big_schema(database_url: str, run_id: str) -> Iterator[str]:
    """200k future rows and 200k parked rows next to a handful of due ones."""
    name = f"od_explain_{run_id}"
    migrate(database_url, name)
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', 'a' || (g % 1000), '{}'::jsonb, now() + interval '1 day', NULL"
        " FROM generate_series(1, 200000) g",
    )
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', 'a' || (g % 1000), '{}'::jsonb, now() - interval '1 day', now()"
        " FROM generate_series(1, 200000) g",
    )
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', NULL, '{}'::jsonb, now() - interval '1 minute', NULL"
        " FROM generate_series(1, 20)",
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'ANALYZE "{name}".outbox')
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')


LEASE = {
    "lease": 30.0,
    "max_attempts": None,
    "park_lost": False,
    "max_lost": 5,
    "flushed_starts": False,
}


def _claim_plan(store: Store, conn: psycopg.Connection[Any], limit: int) -> str:
    """EXPLAIN ANALYZE of the claim's lease (count, pick and lease in one statement), in the
    caller's transaction (roll it back)."""
    params: dict[str, Any] = {
        **LEASE,
        "family": "intent",
        "ids": None,
        "tokens": [],
        "batch": limit,
        "max_in_flight": 10_000,
    }
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + store.q["claim_lease"], params)
    return "\n".join(str(r[0]) for r in plan.fetchall())


def test_claim_reads_an_index_range_not_the_table(database_url: str, big_schema: str) -> None:
    store = Store(database_url, big_schema, pool_size=1)
    try:
        with store.connection() as conn, conn.transaction():
            # as in a claim: the family lock's statement also sets the claim's plan settings
            conn.execute(
                store.q["claim_lock_family"], {"lock_name": "test.plans", "flushed_starts": False}
            )
            rows = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT TEXT) " + store.q["claim_capped_candidates"],
                {"family": "intent", "batch": 500, "max_in_flight": 1000},
            ).fetchall()
            capped_plan = "\n".join(str(r[0]) for r in rows)
            plan = _claim_plan(store, conn, 500)
            raise psycopg.Rollback()  # EXPLAIN ANALYZE ran the claim: undo it
    finally:
        store.close()
    assert "Seq Scan" not in plan, plan
    # the claim touched the 20 due rows, not the 400k others
    scan_line = next(x for x in plan.splitlines() if "Index Scan using outbox_due" in x)
    assert "rows=20 " in scan_line, plan
    assert "outbox_pkey" in plan, plan
    assert "outbox_claimed" in plan, plan  # its in-flight count
    # the capped claim counts its room along the same index and ranks actors only among the
    # due rows, from the same index range
    assert "Seq Scan" not in capped_plan, capped_plan
    assert "outbox_claimed" in capped_plan, capped_plan
    scan_line = next(x for x in capped_plan.splitlines() if "Index Scan using outbox_due" in x)
    assert "rows=20 " in scan_line, capped_plan


@pytest.mark.parametrize("analyzed", [True, False])
def test_claim_plan_scans_nothing_per_row_at_any_size(
    database_url: str, run_id: str, analyzed: bool
) -> None:
    """At tens of thousands of rows the planner once hash-joined the claimed ids against a full
    scan of the table, and on a table without statistics (a fresh deploy's first burst) it ran
    a sequential scan per claimed row (5 s for 2,000 rows)."""
    name = f"od_midsize_{run_id}_{int(analyzed)}"
    migrate(database_url, name)
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', NULL, '{}'::jsonb, now() - interval '1 minute', NULL"
        " FROM generate_series(1, 2000)",
    )
    if analyzed:
        _bulk_insert(
            database_url,
            name,
            "SELECT 'intent', 'x', NULL, '{}'::jsonb, now() - interval '1 day', now()"
            " FROM generate_series(1, 30000)",
        )
    store = Store(database_url, name, pool_size=1)
    try:
        with store.connection() as conn:
            if analyzed:
                conn.execute(f'ANALYZE "{name}".outbox')
            with conn.transaction():
                plan = _claim_plan(store, conn, 500 if analyzed else 2000)
                raise psycopg.Rollback()
    finally:
        store.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')
    assert "Nested Loop" not in plan, plan
    for line in plan.splitlines():  # no scan runs once per row
        assert "Scan" not in line or "loops=1)" in line, plan
    if analyzed:
        assert "Seq Scan" not in plan, plan


def _race_under_repeatable_read(
    dispatcher: Dispatcher,
    database_url: str,
    name: str,
    act: Callable[[Store, Family, int], Any],
) -> list[Any]:
    """A family of ten due rows and max_in_flight 5, and a store whose URL defaults to
    REPEATABLE READ. ``act(store, family, last row id)`` runs in a thread while another
    transaction holds the family's claim lock; that transaction then claims five rows (the
    whole limit) and commits. Returns what ``act`` returned."""
    family = replace(dispatcher.families["intent"], name=name).with_policy(max_in_flight=5)
    _bulk_insert(
        database_url,
        dispatcher.schema,
        f"SELECT '{name}', 'x', NULL, '{{}}'::jsonb, now(), NULL FROM generate_series(1, 10)",
    )
    url = psycopg.conninfo.make_conninfo(
        database_url, options="-c default_transaction_isolation=repeatable\\ read"
    )
    store = Store(url, dispatcher.schema, pool_size=1)
    outbox = f'"{dispatcher.schema}".outbox'
    results: list[Any] = []
    with psycopg.connect(database_url) as conn:
        found = conn.execute(f"SELECT max(id) FROM {outbox} WHERE family = %s", (name,)).fetchone()
    assert found is not None
    try:
        with psycopg.connect(url) as plain:  # the URL's default, as a server's could be
            row = plain.execute("SHOW default_transaction_isolation").fetchone()
            assert row is not None and row[0] == "repeatable read"
        with store.connection() as warm:  # the pool's connection exists before the race
            warm.execute("SELECT 1")
        with psycopg.connect(database_url) as other:  # holds the family lock, fills in-flight
            other.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                (f"{dispatcher.schema}.claim.{name}",),
            )
            racer = threading.Thread(
                target=lambda: results.append(act(store, family, int(found[0])))
            )
            racer.start()
            _wait_for_lock_wait(database_url)
            other.execute(
                f"UPDATE {outbox} SET claim_token = gen_random_uuid(), claimed_at = now(), "
                f"due_at = now() + interval '60 seconds' WHERE id IN "
                f"(SELECT id FROM {outbox} WHERE family = %s ORDER BY id LIMIT 5)",
                (name,),
            )
            other.commit()
            racer.join(10)
    finally:
        store.close()
    assert results, "it raised (see the thread's exception)"
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {outbox} WHERE family = %s AND claim_token IS NOT NULL", (name,)
        ).fetchone()
    assert row is not None and row[0] == 5, "rows leased past max_in_flight"
    return results


def test_a_claim_counts_in_flight_after_its_lock_under_a_repeatable_read_default(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A server (or role, or pooler) whose default isolation is REPEATABLE READ would give a
    claim the snapshot of its first statement, taken before the family lock is granted: it
    would miss the claim it waited for and lease past max_in_flight. Our connections run
    READ COMMITTED whatever the default."""
    name = "rr_" + commands().replace(".", "_")
    (result,) = _race_under_repeatable_read(
        dispatcher, database_url, name, lambda store, family, _: store.claim(family, 100)
    )
    assert result.claimed == [] and result.limit == 0


def _wait_for_lock_wait(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        for _ in range(200):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                " AND datname = current_database()"
            ).fetchone()
            if row and row[0]:
                return
            threading.Event().wait(0.025)
    raise AssertionError("the claim never waited for the family lock")


def test_a_pipelined_transaction_that_fails_keeps_nothing_and_gives_its_connection_back_idle(
    database_url: str, schema: str
) -> None:
    """Claims and settles send BEGIN and COMMIT as statements of their pipeline (one round
    trip): a failure inside, in SQL or in Python, must roll back what the block wrote and
    leave the connection idle for the pool."""
    table = f'"{schema}".pipelined_probe'
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (x int)")
        try:
            with pytest.raises(psycopg.errors.DivisionByZero), pipelined_transaction(conn):
                conn.execute(f"INSERT INTO {table} VALUES (1)")
                conn.execute("SELECT 1 / 0")
            assert conn.info.transaction_status == TransactionStatus.IDLE
            with pytest.raises(RuntimeError), pipelined_transaction(conn):
                conn.execute(f"INSERT INTO {table} VALUES (2)")
                raise RuntimeError("the block failed after its statements were queued")
            assert conn.info.transaction_status == TransactionStatus.IDLE
            with pipelined_transaction(conn):
                cur = conn.execute(f"INSERT INTO {table} VALUES (3) RETURNING x")
            assert cur.fetchall() == [(3,)]
            assert conn.info.transaction_status == TransactionStatus.IDLE
            assert conn.execute(f"SELECT x FROM {table}").fetchall() == [(3,)]
        finally:
            conn.execute(f"DROP TABLE {table}")
