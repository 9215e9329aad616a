"""The peers, driven through their documented APIs on the same Postgres and Redis.

- **procrastinate**: a fresh database with its schema (``schema_manager.apply_schema()``);
  jobs deferred with ``configure_task(..., connection=conn).batch_defer(...)`` inside our
  psycopg transactions (1,000 jobs per transaction, as the outbox producer); one worker
  process, ``app.run_worker(concurrency=C)``, default options (LISTEN/NOTIFY on, jobs kept as
  ``succeeded``); async tasks that do the same Redis INCR as every other handler.
- **django-celery-outbox**: Django configured in-process (``settings.configure``), its
  migrations applied in a fresh database, ``task.delay()`` on an ``OutboxCelery`` app inside
  ``transaction.atomic()`` (1,000 per transaction); its relay, the ``celery_outbox_relay``
  management command, publishes them to the same Redis broker, where the plain-Celery
  baseline's worker (same command, same tasks) runs them. The relay gets the batch size and
  idle time of our claimer (500 rows, 0.2 s) instead of its defaults (100, 1 s); StatsD
  metrics are off (nothing listens here).

These modules are imported only in the benchmark's venv (``scripts/bench`` makes it), so the
peers never become dependencies of outbox_dispatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.procs import (
    COUNTER,
    LATENCIES,
    System,
    celery,
    pace_loop,
    python_module,
    say,
)

PROCRASTINATE_DB = "outbox_bench_procrastinate"
DCO_DB = "outbox_bench_dco"
TX_ROWS = 1000  # rows per producer transaction, for every system
RELAY_BATCH = 500  # our claimer's claim_batch
RELAY_IDLE = 0.2  # the relay's poll interval: it has no commit wake, so this is its latency
DCO_APP = "bench.dco_app.app"


def database_url() -> str:
    from bench.app import DATABASE_URL

    return DATABASE_URL


def peer_dsn(db: str) -> str:
    """The benchmark's Postgres, another database."""
    return make_conninfo(database_url(), dbname=db)


@contextmanager
def fresh_database(db: str) -> Iterator[str]:
    """A database created for one peer and dropped afterwards (also after a failure)."""
    name = sql.Identifier(db)
    with psycopg.connect(database_url(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(name))
    try:
        yield peer_dsn(db)
    finally:
        with psycopg.connect(database_url(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))


# -- procrastinate ------------------------------------------------------------------------------

_aredis: Any = None


def _async_redis() -> Any:
    """One asyncio Redis client for the worker's event loop."""
    global _aredis
    if _aredis is None:
        import redis.asyncio

        from bench.app import REDIS_URL

        _aredis = redis.asyncio.Redis.from_url(REDIS_URL)
    return _aredis


def procrastinate_app(dsn: str, *, sync: bool) -> Any:
    """The peer's App: a sync connector for producing and schema, an async one for the
    worker (its documented setup for each)."""
    import procrastinate

    connector = (
        procrastinate.SyncPsycopgConnector(conninfo=dsn)
        if sync
        else procrastinate.PsycopgConnector(conninfo=dsn)
    )
    app = procrastinate.App(connector=connector)

    async def bench_noop(n: int) -> None:
        await _async_redis().incr(COUNTER)

    async def bench_latency(sent: float) -> None:
        client = _async_redis()
        await client.rpush(LATENCIES, time.time() - sent)
        await client.incr(COUNTER)

    app.task(name="bench_noop")(bench_noop)
    app.task(name="bench_latency")(bench_latency)
    return app


def procrastinate_worker(dsn: str, concurrency: int) -> None:
    """The worker process: ``app.run_worker`` until SIGTERM (its own graceful stop)."""
    app = procrastinate_app(dsn, sync=False)
    app.run_worker(concurrency=concurrency)


@contextmanager
def procrastinate_system(concurrency: int) -> Iterator[System]:
    with fresh_database(PROCRASTINATE_DB) as dsn:
        app = procrastinate_app(dsn, sync=True)
        with app.open():
            app.schema_manager.apply_schema()

        def produce(n: int) -> None:
            with psycopg.connect(dsn) as conn:
                for start in range(0, n, TX_ROWS):
                    jobs = [{"n": i} for i in range(start, min(n, start + TX_ROWS))]
                    with conn.transaction():
                        app.configure_task("bench_noop", connection=conn).batch_defer(*jobs)

        def paced(pace: int, seconds: float) -> int:
            with psycopg.connect(dsn) as conn:

                def one(sent: float) -> None:
                    with conn.transaction():  # one business transaction per job
                        app.configure_task("bench_latency", connection=conn).defer(sent=sent)

                return pace_loop(one, pace, seconds)

        worker = python_module(
            __name__,
            "procrastinate-worker",
            "--dsn",
            dsn,
            "--concurrency",
            str(concurrency),
            name="procrastinate-worker",
        )
        yield System(
            "procrastinate",
            "procrastinate",
            [worker],
            produce,
            paced,
            note=f"1 worker process, run_worker(concurrency={concurrency}), async tasks",
        )
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*)"
                " FROM procrastinate_jobs"
            ).fetchone()
        if row:
            say(f"  procrastinate: {row[0]:,} of {row[1]:,} jobs succeeded")


# -- django-celery-outbox -----------------------------------------------------------------------


def configure_django(db: str) -> None:
    """Django in this process, on the benchmark's Postgres; once per process (Django's rule)."""
    import django
    from django.conf import settings

    if settings.configured:
        if settings.DATABASES["default"]["NAME"] != db:
            raise RuntimeError(f"Django is already configured for {settings.DATABASES}")
        return
    params = conninfo_to_dict(database_url())
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": db,
                "USER": str(params.get("user", "")),
                "PASSWORD": str(params.get("password", "")),
                "HOST": str(params.get("host", "")),
                "PORT": str(params.get("port", "")),
            }
        },
        INSTALLED_APPS=["django_celery_outbox"],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        CELERY_OUTBOX_APP=DCO_APP,
        MONITORING_METRICS_ENABLED=False,
    )
    django.setup()


def dco_relay(db: str, batch: int, idle: float) -> None:
    """The relay process: its management command, as ``manage.py celery_outbox_relay``."""
    configure_django(db)
    from django.core.management import call_command

    call_command("celery_outbox_relay", batch_size=batch, idle_time=idle)


@contextmanager
def dco_system(concurrency: int, pool: str) -> Iterator[System]:
    with fresh_database(DCO_DB):
        configure_django(DCO_DB)
        from django.core.management import call_command
        from django.db import connections, transaction

        from bench import dco_app

        call_command("migrate", "django_celery_outbox", verbosity=0)

        def produce(n: int) -> None:
            for start in range(0, n, TX_ROWS):
                with transaction.atomic():
                    for i in range(start, min(n, start + TX_ROWS)):
                        dco_app.noop.delay(i)

        def paced(pace: int, seconds: float) -> int:
            def one(sent: float) -> None:
                with transaction.atomic():  # one business transaction per task
                    dco_app.latency.delay(sent)

            return pace_loop(one, pace, seconds)

        worker = celery("worker", "-P", pool, "-c", str(concurrency), "--loglevel", "WARNING")
        relay = python_module(
            __name__,
            "dco-relay",
            "--db",
            DCO_DB,
            "--batch-size",
            str(RELAY_BATCH),
            "--idle-time",
            str(RELAY_IDLE),
            name="dco-relay",
        )
        try:
            yield System(
                "django-celery-outbox",
                "django-celery-outbox",
                [worker, relay],
                produce,
                paced,
                note=(
                    f"plain-Celery worker (-P {pool} -c {concurrency}) + 1 relay process "
                    f"(batch {RELAY_BATCH}, idle {RELAY_IDLE} s)"
                ),
            )
        finally:
            connections.close_all()


def peer_systems() -> dict[str, Any]:
    """Name -> context manager factory, in the order the tables show them."""
    return {"procrastinate": procrastinate_system, "django-celery-outbox": dco_system}


def installed() -> dict[str, str]:
    """Versions of the peers in this venv ('' when one is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("procrastinate", "django-celery-outbox", "Django", "celery", "matplotlib"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = ""
    return out


# -- subprocess entry points --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="benchmark peer processes")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("procrastinate-worker")
    p.add_argument("--dsn", required=True)
    p.add_argument("--concurrency", type=int, default=2)
    p = sub.add_parser("dco-relay")
    p.add_argument("--db", required=True)
    p.add_argument("--batch-size", type=int, default=RELAY_BATCH)
    p.add_argument("--idle-time", type=float, default=RELAY_IDLE)
    args = parser.parse_args(argv)
    if args.cmd == "procrastinate-worker":
        procrastinate_worker(args.dsn, args.concurrency)
    else:
        dco_relay(args.db, args.batch_size, args.idle_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
