"""``python -m bench.drivers``: what one ``enqueue`` costs on each driver a shop may hold,
as a ratio to psycopg 3 in sync code, in the same run.

Each driver enqueues ``--rows`` rows, one call each, in one transaction of its own, which it
then rolls back (the table stays empty, so no driver pays for another's rows). Rounds are
interleaved: every driver once per round, in a rotated order; the table gives the median
microseconds per row over the rounds, with their range, and the ratio of the medians."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

import asyncpg
import psycopg
import psycopg2
from celery import Celery
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox_dispatch import Dispatcher
from outbox_dispatch.store.migrations import migrate

Timer = Callable[[Dispatcher, str, int], float]  # -> seconds for n enqueues


def _sa(url: str, driver: str) -> str:
    return url.replace("postgresql://", f"postgresql+{driver}://", 1)


def _psycopg(d: Dispatcher, url: str, n: int) -> float:
    with psycopg.connect(url) as conn:
        d.enqueue(conn, "bench.row", {"i": -1})  # connection warm, first statement prepared
        t0 = time.perf_counter()
        for i in range(n):
            d.enqueue(conn, "bench.row", {"i": i})
        elapsed = time.perf_counter() - t0
        conn.rollback()
    return elapsed


def _psycopg2(d: Dispatcher, url: str, n: int) -> float:
    conn = psycopg2.connect(url)
    try:
        d.enqueue(conn, "bench.row", {"i": -1})
        t0 = time.perf_counter()
        for i in range(n):
            d.enqueue(conn, "bench.row", {"i": i})
        elapsed = time.perf_counter() - t0
        conn.rollback()
    finally:
        conn.close()
    return elapsed


def _sqlalchemy(driver: str) -> Callable[[Dispatcher, str, int], float]:
    def run(d: Dispatcher, url: str, n: int) -> float:
        engine = create_engine(_sa(url, driver))
        try:
            with Session(engine) as session:
                d.enqueue(session, "bench.row", {"i": -1})
                t0 = time.perf_counter()
                for i in range(n):
                    d.enqueue(session, "bench.row", {"i": i})
                elapsed = time.perf_counter() - t0
                session.rollback()
        finally:
            engine.dispose()
        return elapsed

    return run


def _apsycopg(d: Dispatcher, url: str, n: int) -> float:
    async def run() -> float:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            await d.aenqueue(conn, "bench.row", {"i": -1})
            t0 = time.perf_counter()
            for i in range(n):
                await d.aenqueue(conn, "bench.row", {"i": i})
            elapsed = time.perf_counter() - t0
            await conn.rollback()
        return elapsed

    return asyncio.run(run())


def _asyncpg(d: Dispatcher, url: str, n: int) -> float:
    async def run() -> float:
        conn = await asyncpg.connect(url)
        try:
            tx = conn.transaction()
            await tx.start()
            await d.aenqueue(conn, "bench.row", {"i": -1})
            t0 = time.perf_counter()
            for i in range(n):
                await d.aenqueue(conn, "bench.row", {"i": i})
            elapsed = time.perf_counter() - t0
            await tx.rollback()
        finally:
            await conn.close()
        return elapsed

    return asyncio.run(run())


def _sqlalchemy_async(driver: str) -> Callable[[Dispatcher, str, int], float]:
    def run(d: Dispatcher, url: str, n: int) -> float:
        async def go() -> float:
            engine = create_async_engine(_sa(url, driver))
            try:
                async with AsyncSession(engine) as session:
                    await d.aenqueue(session, "bench.row", {"i": -1})
                    t0 = time.perf_counter()
                    for i in range(n):
                        await d.aenqueue(session, "bench.row", {"i": i})
                    elapsed = time.perf_counter() - t0
                    await session.rollback()
            finally:
                await engine.dispose()
            return elapsed

        return asyncio.run(go())

    return run


DRIVERS: dict[str, Callable[[Dispatcher, str, int], float]] = {
    "psycopg": _psycopg,
    "psycopg2": _psycopg2,
    "sqlalchemy+psycopg": _sqlalchemy("psycopg"),
    "sqlalchemy+psycopg2": _sqlalchemy("psycopg2"),
    "psycopg async": _apsycopg,
    "asyncpg": _asyncpg,
    "sqlalchemy async+psycopg": _sqlalchemy_async("psycopg"),
    "sqlalchemy async+asyncpg": _sqlalchemy_async("asyncpg"),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    o = p.parse_args(argv)
    schema = f"bench_drivers_{uuid.uuid4().hex[:8]}"
    migrate(o.database_url, schema)
    d = Dispatcher(
        Celery("drivers", broker="memory://"), database_url=o.database_url, schema=schema
    )
    d.declare("bench.row")
    names = list(DRIVERS)
    per_row: dict[str, list[float]] = {name: [] for name in names}
    try:
        for rnd in range(o.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                seconds = DRIVERS[name](d, o.database_url, o.rows)
                per_row[name].append(seconds / o.rows * 1e6)
    finally:
        d.close()
        with psycopg.connect(o.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    base = statistics.median(per_row["psycopg"])
    print("| driver | µs per enqueue | ratio to psycopg (sync) |")
    print("| --- | --- | --- |")
    for name in names:
        values = per_row[name]
        mid = statistics.median(values)
        print(f"| {name} | {mid:.0f} ({min(values):.0f}-{max(values):.0f}) | {mid / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
