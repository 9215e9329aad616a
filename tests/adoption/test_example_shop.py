"""examples/celery_shop, run as its users run it: a real ``celery worker -B`` process on the
project's own app (``task_cls=OutboxTask``, its tasks unchanged), orders placed by the
project's own code, one of them rolled back. Every committed order is charged (after the
gateway's first timeout, through ``self.retry``) and gets one receipt; the rolled-back one
gets neither."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import drop_run
from tests.fixtures.processes import ROOT, cli, worker_with_beat

EXAMPLE = ROOT / "examples" / "celery_shop"


@pytest.fixture
def shop_env(database_url: str, redis_url: str, run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_shop_{run_id}"
    prefix = f"od_shop_{run_id}:"
    # the shop's own tables land in the test's schema through the search_path
    url = f"{database_url}?options=-csearch_path%3D{schema}"
    env = {
        **os.environ,
        "SHOP_DATABASE_URL": url,
        "SHOP_OUTBOX_SCHEMA": schema,
        "SHOP_BROKER_URL": redis_url,
        "SHOP_KEY_PREFIX": prefix,
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(ROOT)]),
        "PYTHONUNBUFFERED": "1",
    }
    yield env
    drop_run(database_url, schema, redis_url, prefix)


def test_the_shop_moved_by_one_line_delivers_each_committed_order_once(
    shop_env: dict[str, str],
    spawn: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    for key, value in shop_env.items():
        if key.startswith("SHOP_"):
            monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "shop" or m.startswith("shop.")]:
        monkeypatch.delitem(sys.modules, name)  # the shop reads its environment at import
    done = cli(shop_env, "--app", "shop.celery:dispatcher", "migrate")
    assert done.returncode == 0, done.stderr
    from shop.celery import dispatcher
    from shop.db import connect, create_tables
    from shop.orders import OutOfStock, place_order

    request.addfinalizer(dispatcher.close)
    create_tables()
    worker = spawn(
        worker_with_beat("shop.celery", tmp_path),
        shop_env,
        "shop-worker",
    )
    placed = [place_order(f"customer {i}", 100 * i) for i in range(1, 5)]
    with pytest.raises(OutOfStock):
        place_order("too late", 999, in_stock=False)

    def settled() -> tuple[int, int]:
        with connect() as conn:
            receipts = conn.execute("SELECT count(*) FROM receipts").fetchone()
            charged = conn.execute("SELECT count(*) FROM charges WHERE ok").fetchone()
        assert receipts is not None and charged is not None
        return int(receipts[0]), int(charged[0])

    deadline = time.monotonic() + 60
    while settled() != (len(placed), len(placed)) and time.monotonic() < deadline:
        assert worker.poll() is None, (tmp_path / "shop-worker.log").read_text()[-3000:]
        time.sleep(0.2)
    log = (tmp_path / "shop-worker.log").read_text()
    assert settled() == (len(placed), len(placed)), log[-3000:]
    with connect() as conn:
        orders = [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
        receipts = [r[0] for r in conn.execute("SELECT order_id FROM receipts ORDER BY 1")]
        charges = conn.execute(
            "SELECT order_id, attempt, ok FROM charges ORDER BY order_id, attempt"
        ).fetchall()
    assert orders == placed and receipts == placed  # the rolled-back order left nothing
    # each charge timed out once, then its self.retry(countdown=1) ran it again
    assert charges == [(o, a, a == 2) for o in placed for a in (1, 2)]
    # every row settled (a worker settles a delivered row within a few ms of its handler)
    outbox = f'"{shop_env["SHOP_OUTBOX_SCHEMA"]}".outbox'
    deadline = time.monotonic() + 10
    while True:
        with connect() as conn:
            left = conn.execute(f"SELECT count(*) FROM {outbox}").fetchone()
        if left == (0,) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == (0,)
    # the worker ran the tasks under their own names
    assert "shop.tasks.charge_card" in log and "GatewayTimeout" in log
