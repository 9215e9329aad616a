"""``python -m bench.bulk``: a bulk retry of ``--rows`` parked rows selected by command, as an
operator runs it after an outage: the total time, and the longest batch, which is the longest
any row lock is held (each batch is a transaction of its own). Rows of another command are
parked beside them and must stay parked."""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Sequence

import psycopg
from celery import Celery

from outbox_dispatch import Dispatcher
from outbox_dispatch.core.rows import RowFilter
from outbox_dispatch.ops import actions


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=500)
    o = p.parse_args(argv)
    schema = f"bench_bulk_{uuid.uuid4().hex[:8]}"
    app = Celery("bulk", broker="memory://")
    d = Dispatcher(app, database_url=o.database_url, schema=schema, listen=False)
    d.family("mail")
    d.migrate()
    try:
        with psycopg.connect(o.database_url, autocommit=True) as conn:
            for command, n in (("mail.send", o.rows), ("mail.other", o.rows // 10)):
                conn.execute(
                    f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at,'
                    " attempts, last_error) SELECT 'mail', %s, '{}', now(), 10,"
                    " 'ConnectionError: provider down' FROM generate_series(1, %s)",
                    (command, n),
                )
            conn.execute(f'VACUUM ANALYZE "{schema}".outbox')
        batches: list[float] = []
        last = [time.perf_counter()]

        def progress(done: int, count: int) -> None:
            now = time.perf_counter()
            batches.append(now - last[0])
            last[0] = now

        t0 = time.perf_counter()
        last[0] = t0
        found = actions.bulk(
            d, "retry", RowFilter(command="mail.send"), by="bench", batch=o.batch, progress=progress
        )
        total = time.perf_counter() - t0
        with psycopg.connect(o.database_url) as conn:
            row = conn.execute(
                f"SELECT count(*) FILTER (WHERE parked_at IS NULL AND command = %s),"
                f" count(*) FILTER (WHERE parked_at IS NOT NULL AND command = %s)"
                f' FROM "{schema}".outbox',
                ("mail.send", "mail.other"),
            ).fetchone()
        if row is None or (row[0], row[1]) != (o.rows, o.rows // 10):
            raise SystemExit(f"bulk retry touched the wrong rows: {row}")
        print(
            f"bulk retry of {found.done:,} parked rows by command, batches of {o.batch}: "
            f"{total:.1f} s ({found.done / total:,.0f} rows/s); {len(batches)} batches, "
            f"median {statistics.median(batches) * 1000:.0f} ms, longest "
            f"{max(batches) * 1000:.0f} ms (the longest a row lock is held)"
        )
    finally:
        d.close()
        with psycopg.connect(o.database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
