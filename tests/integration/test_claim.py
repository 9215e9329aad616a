"""Claims: concurrent claimers never share a row, backpressure, and the claim's query plan."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.migrations import migrate
from outbox_dispatch.store import Store
from tests.conftest import count_rows


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


def test_claim_never_exceeds_max_in_flight(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands(family="quick")
    _bulk_insert(
        database_url,
        dispatcher.schema,
        f"SELECT 'quick', '{cmd}', NULL, '{{}}'::jsonb, now(), NULL FROM generate_series(1, 300)",
    )
    family = dispatcher.families["quick"].with_policy(max_in_flight=120)
    first = dispatcher.claimer.claim_family(family, batch=100)
    second = dispatcher.claimer.claim_family(family, batch=100)
    third = dispatcher.claimer.claim_family(family, batch=100)
    assert (len(first.claimed), len(second.claimed), len(third.claimed)) == (100, 20, 0)
    # settling frees capacity again
    for c in first.claimed[:30]:
        assert dispatcher.store.settle("delete", c.id, c.token)
    assert len(dispatcher.claimer.claim_family(family, batch=100).claimed) == 30


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


def test_claim_reads_an_index_range_not_the_table(database_url: str, big_schema: str) -> None:
    store = Store(database_url, big_schema, pool_size=1)
    params = {
        "family": "intent",
        "limit": 500,
        "lease": 30.0,
        "max_attempts": None,
        "park_lost": False,
        "max_lost": 5,
    }
    try:
        with store.connection() as conn, conn.transaction():
            rows = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT TEXT) " + store.q["capped_candidates"],
                {"family": "intent", "probe": 2000},
            ).fetchall()
            capped_plan = "\n".join(str(r[0]) for r in rows)
            rows = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT TEXT) " + store.q["claim"], params
            ).fetchall()
            plan = "\n".join(str(r[0]) for r in rows)
            rows = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT TEXT) " + store.q["in_flight"], {"family": "intent"}
            ).fetchall()
            in_flight_plan = "\n".join(str(r[0]) for r in rows)
            raise psycopg.Rollback()  # EXPLAIN ANALYZE ran the claim: undo it
    finally:
        store.close()
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using outbox_due" in plan, plan
    # the claim touched the 20 due rows, not the 400k others
    scan_line = next(line for line in plan.splitlines() if "Index Scan using outbox_due" in line)
    assert "rows=20 " in scan_line, plan
    assert "Seq Scan" not in in_flight_plan, in_flight_plan
    assert "outbox_claimed" in in_flight_plan, in_flight_plan
    # the capped claim ranks actors only among the due rows, from the same index range
    assert "Seq Scan" not in capped_plan, capped_plan
    scan_line = next(x for x in capped_plan.splitlines() if "Index Scan using outbox_due" in x)
    assert "rows=20 " in scan_line, capped_plan


def test_claim_plan_has_no_table_scan_at_a_mid_size_either(database_url: str, run_id: str) -> None:
    """At tens of thousands of rows the planner once hash-joined the claimed ids against a full
    scan of the table; the claim must stay on indexes at every size."""
    name = f"od_midsize_{run_id}"
    migrate(database_url, name)
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', NULL, '{}'::jsonb, now() - interval '1 minute', NULL"
        " FROM generate_series(1, 500)",
    )
    _bulk_insert(
        database_url,
        name,
        "SELECT 'intent', 'x', NULL, '{}'::jsonb, now() - interval '1 day', now()"
        " FROM generate_series(1, 30000)",
    )
    store = Store(database_url, name, pool_size=1)
    params = {
        "family": "intent",
        "limit": 500,
        "lease": 30.0,
        "max_attempts": None,
        "park_lost": False,
        "max_lost": 5,
    }
    try:
        with store.connection() as conn:
            conn.execute(f'ANALYZE "{name}".outbox')
            with conn.transaction():
                rows = conn.execute("EXPLAIN (ANALYZE) " + store.q["claim"], params).fetchall()
                plan = "\n".join(str(r[0]) for r in rows)
                raise psycopg.Rollback()
    finally:
        store.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')
    assert "Seq Scan" not in plan, plan
