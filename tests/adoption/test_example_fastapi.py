"""examples/fastapi_shop, run as its users run it: the outbox migrated with the CLI, a real
``celery worker -B`` process started in the example's directory on its own app, and the FastAPI
app driven in-process by ``TestClient``. An order posted through the API is confirmed by the
worker; an order whose request fails after its ``aenqueue`` leaves no order, no outbox row and
no confirmation, also once the worker has delivered the row committed after it.

The shop keeps its tables in the database's default schema, as a shop does: the test gives it
a database of its own (the outbox in a fresh schema there, Redis keys under a prefix of the
run's), dropped afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.conftest import drop_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fastapi_shop"
# the example README's commands, run in the example's directory
MIGRATE = ["--app", "shop.outbox:dispatcher", "migrate"]
WORKER = ["-A", "shop.outbox", "worker", "-B", "--loglevel", "INFO"]
DEADLINE = 60.0  # seconds to wait for the worker: a bound on a hang, not a speed asserted


def _url(database_url: str, dbname: str) -> str:
    """``database_url`` on another database, as a postgresql:// URL (the shop's asyncpg URL
    is made from it)."""
    params = {**conninfo_to_dict(database_url), "dbname": dbname}
    user = params.get("user", "")
    password = f":{params['password']}" if params.get("password") else ""
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    auth = f"{user}{password}@" if user else ""
    assert set(params) <= {"user", "password", "host", "port", "dbname"}, params
    return f"postgresql://{auth}{host}:{port}/{dbname}"


@pytest.fixture
def shop_env(database_url: str, redis_url: str, run_id: str) -> Iterator[dict[str, str]]:
    """The shop's environment: a database of its own, a fresh outbox schema in it (migrated
    with the CLI, as the example's README does) and a Redis key prefix of its own."""
    name = f"od_fastapi_{run_id}"
    prefix = f"{name}:"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _url(database_url, name)
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": redis_url,
        "OUTBOX_SCHEMA": name,
        "REDIS_KEY_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "outbox_dispatch.ops.cli", *MIGRATE],
            env=env,
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield env
    finally:
        drop_run(url, name, redis_url, prefix)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def worker(shop_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A shop.outbox worker -B`` in the example's directory, stopped (warm, then
    killed) after the test; its log's tail is printed, which pytest shows when a test failed."""
    log_path = tmp_path / "worker.log"
    schedule = tmp_path / "beat-schedule"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", *WORKER, "-c", "2", "-s", str(schedule)],
            env=shop_env,
            cwd=EXAMPLE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            lines = log_path.read_text(errors="replace").splitlines()
            print(f"--- worker.log, last {min(len(lines), 60)} lines ---")
            print("\n".join(lines[-60:]))


def _log(tmp_path: Path) -> str:
    return (tmp_path / "worker.log").read_text(errors="replace")[-3000:]


def _one(conninfo: str, sql: str) -> Any:
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return row[0]


# Starlette 1.x asks for httpx2 in its TestClient and warns when it finds only httpx (the dev
# extras' client): a warning about the test's client, not about the shop
@pytest.mark.filterwarnings("ignore:Using .httpx. with .starlette.testclient. is deprecated")
def test_an_order_is_confirmed_and_an_order_that_failed_after_its_enqueue_leaves_nothing(
    shop_env: dict[str, str],
    worker: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    for key in ("DATABASE_URL", "REDIS_URL", "OUTBOX_SCHEMA", "REDIS_KEY_PREFIX"):
        monkeypatch.setenv(key, shop_env[key])
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "shop" or m.startswith("shop.")]:
        monkeypatch.delitem(sys.modules, name)  # the shop reads its environment at import
    from fastapi.testclient import TestClient

    # mypy checks examples/celery_shop's `shop`, not this one (both are named shop)
    from shop.api import app  # type: ignore[import-not-found, unused-ignore]
    from shop.outbox import dispatcher  # type: ignore[import-not-found, unused-ignore]

    request.addfinalizer(dispatcher.close)
    url, schema = shop_env["DATABASE_URL"], shop_env["OUTBOX_SCHEMA"]
    outbox = f'"{schema}".outbox'
    order = {"customer": "ada", "email": "ada@example.com", "cents": 1200}

    with TestClient(app, raise_server_exceptions=False) as client:  # runs the app's lifespan
        failed = client.post("/orders", params={"fail": 1}, json=order)
        assert failed.status_code == 500, failed.text
        # the failed request did write its row (the id was taken) before it rolled back
        seq = f"pg_get_serial_sequence('{outbox}', 'id')"
        assert _one(url, f"SELECT pg_sequence_last_value({seq})") == 1
        placed = client.post("/orders", json=order)
        assert placed.status_code == 201, placed.text
        order_id = placed.json()["id"]
        assert order_id == 2  # the failed order took id 1, and left no order behind it

        deadline = time.monotonic() + DEADLINE
        while True:
            got = client.get(f"/orders/{order_id}")
            assert got.status_code == 200, got.text
            if got.json()["confirmed"] or time.monotonic() > deadline:
                break
            assert worker.poll() is None, _log(tmp_path)
            time.sleep(0.1)
        assert got.json() == {"id": order_id, "customer": "ada", "cents": 1200, "confirmed": True}
        assert client.get("/orders/1").status_code == 404

    # the delivered row is settled (deleted: the family keeps no retention) within moments
    deadline = time.monotonic() + DEADLINE
    while _one(url, f"SELECT count(*) FROM {outbox}") and time.monotonic() < deadline:
        time.sleep(0.05)
    with psycopg.connect(url) as conn:
        orders = conn.execute("SELECT id, customer, email, cents FROM orders").fetchall()
        confirmations = conn.execute("SELECT order_id, email FROM confirmations").fetchall()
        rows = conn.execute(f"SELECT id, command FROM {outbox}").fetchall()
    assert orders == [(order_id, "ada", "ada@example.com", 1200)]
    assert confirmations == [(order_id, "ada@example.com")]
    assert rows == []
    assert "order.confirm" in _log(tmp_path)  # the worker ran the row, under its command
