"""Claim cost follows due rows, not stored rows: the time of one claim of 500 due rows in a
schema holding nothing else, and in one holding 1,000,000 rows that are not due (future,
parked, retained) besides.

The two are timed alternately, claim by claim, each on its own schema, so that the machine
changing between them (a checkpoint writing back the million inserts, other jobs) lands on
both sides; and both tables collect the same dead row versions from the resets and claims,
which this machine's Postgres, running without autovacuum, keeps."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import psycopg

from bench.procs import say
from outbox_dispatch.core.naming import quoted
from outbox_dispatch.core.policy import Family
from outbox_dispatch.store import Store
from outbox_dispatch.store.migrations import migrate

DUE = 500
FAMILY = Family("bench", max_attempts=None, lease=60, max_in_flight=10 * DUE)
REPEAT = 21


@dataclass
class ClaimCost:
    stored_not_due: int
    median_ms: float


def _reset_due(conn: psycopg.Connection[tuple[object, ...]], table: str) -> None:
    conn.execute(
        f"UPDATE {table} SET claim_token = NULL, started_at = NULL, attempts = 0,"
        " due_at = now() - interval '1 second' WHERE command = 'due'"
    )


def _time_claim(store: Store, conn: psycopg.Connection[tuple[object, ...]], table: str) -> float:
    _reset_due(conn, table)
    t0 = time.perf_counter()
    result = store.claim(FAMILY, DUE)
    elapsed = (time.perf_counter() - t0) * 1000
    assert len(result.claimed) == DUE
    return elapsed


def _store_not_due(conn: psycopg.Connection[tuple[object, ...]], table: str, stored: int) -> None:
    third = stored // 3
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


def claim_cost(database_url: str, schema: str, stored: int = 1_000_000) -> list[ClaimCost]:
    schemas = (schema, f"{schema}_stored")  # nothing but the due rows; the due rows and more
    with psycopg.connect(database_url, autocommit=True) as conn:
        for name in schemas:
            conn.execute(f"DROP SCHEMA IF EXISTS {quoted(name)} CASCADE")
    tables = [f"{quoted(name)}.outbox" for name in schemas]
    stores: list[Store] = []
    try:
        for name in schemas:
            migrate(database_url, name)
            stores.append(Store(database_url, name, pool_size=1))
        with psycopg.connect(database_url, autocommit=True) as conn:
            for table in tables:
                conn.execute(
                    f"INSERT INTO {table} (family, command, payload) "
                    f"SELECT 'bench', 'due', '{{}}' FROM generate_series(1, {DUE})"
                )
            say(f"  storing {stored:,} rows that are not due (future, parked, retained)...")
            _store_not_due(conn, tables[1], stored)
            for table in tables:
                conn.execute(f"ANALYZE {table}")
            times: tuple[list[float], list[float]] = ([], [])
            for k in range(REPEAT):  # alternately, each side first every other time
                for side in (0, 1) if k % 2 == 0 else (1, 0):
                    times[side].append(_time_claim(stores[side], conn, tables[side]))
        out = [
            ClaimCost(0, round(statistics.median(times[0]), 2)),
            ClaimCost(stored, round(statistics.median(times[1]), 2)),
        ]
        say(
            f"  claim of {DUE} due rows, alternately: {out[0].median_ms} ms alone, "
            f"{out[1].median_ms} ms next to {stored:,} others"
        )
        return out
    finally:
        for store in stores:
            store.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            for name in schemas:
                conn.execute(f"DROP SCHEMA IF EXISTS {quoted(name)} CASCADE")
