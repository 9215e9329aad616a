"""Claim cost follows due rows, not stored rows: the time of one claim of 500 due rows, with
no other rows and then with 1,000,000 rows that are not due (future, parked, retained)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import psycopg

from bench.procs import say
from outbox_dispatch.migrations import migrate
from outbox_dispatch.naming import quoted
from outbox_dispatch.policy import Family
from outbox_dispatch.store import Store

DUE = 500
FAMILY = Family("bench", max_attempts=None, lease=60, max_in_flight=10 * DUE)
REPEAT = 15


@dataclass
class ClaimCost:
    stored_not_due: int
    median_ms: float


def _reset_due(conn: psycopg.Connection[tuple[object, ...]], table: str) -> None:
    conn.execute(
        f"UPDATE {table} SET claim_token = NULL, started_at = NULL, attempts = 0,"
        " due_at = now() - interval '1 second' WHERE command = 'due'"
    )


def _time_claims(store: Store, conn: psycopg.Connection[tuple[object, ...]], table: str) -> float:
    times = []
    for _ in range(REPEAT):
        _reset_due(conn, table)
        t0 = time.perf_counter()
        result = store.claim(FAMILY, DUE)
        times.append((time.perf_counter() - t0) * 1000)
        assert len(result.claimed) == DUE
    return statistics.median(times)


def claim_cost(database_url: str, schema: str, stored: int = 1_000_000) -> list[ClaimCost]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {quoted(schema)} CASCADE")
    migrate(database_url, schema)
    table = f"{quoted(schema)}.outbox"
    store = Store(database_url, schema, pool_size=1)
    out = []
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO {table} (family, command, payload) "
                f"SELECT 'bench', 'due', '{{}}' FROM generate_series(1, {DUE})"
            )
            conn.execute(f"ANALYZE {table}")
            out.append(ClaimCost(0, round(_time_claims(store, conn, table), 2)))
            say(f"  claim of {DUE} due rows, nothing else stored: {out[-1].median_ms} ms")
            third = stored // 3
            say(f"  storing {stored:,} rows that are not due (future, parked, retained)...")
            conn.execute(
                f"INSERT INTO {table} (family, command, payload, due_at) "
                f"SELECT 'bench', 'future', '{{}}', now() + interval '1 day'"
                f" FROM generate_series(1, {third})"
            )
            conn.execute(
                f"INSERT INTO {table} (family, command, payload, due_at, parked_at) "
                f"SELECT 'bench', 'parked', '{{}}', now() - interval '1 day', now()"
                f" FROM generate_series(1, {third})"
            )
            conn.execute(
                f"INSERT INTO {table} (family, command, payload, due_at, done_at) "
                f"SELECT 'bench', 'kept', '{{}}', now() - interval '1 day', now()"
                f" FROM generate_series(1, {stored - 2 * third})"
            )
            conn.execute(f"ANALYZE {table}")
            out.append(ClaimCost(stored, round(_time_claims(store, conn, table), 2)))
            say(f"  claim of {DUE} due rows next to {stored:,} others: {out[-1].median_ms} ms")
    finally:
        store.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {quoted(schema)} CASCADE")
    return out
