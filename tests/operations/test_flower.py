"""Flower tells the truth and stays quiet, read from a real Flower process's HTTP API against
a real prefork worker with task events on (and beat): each delivery is named
``<family>:<command>`` with its row, actor and attempt; its state is the row's outcome
(delivered SUCCESS, a retried attempt RETRY with its error, parked FAILURE, cancelled
REVOKED, a stale message STALE); a batched message's result lists its rows' outcomes; and no
maintenance task (claim, prune, cron, an expired claim message) is listed."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Message
from tests.chaos.services import free_port
from tests.fixtures.processes import worker_with_beat


def _tasks(port: int) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=5) as r:
        found: dict[str, dict[str, Any]] = json.load(r)
    return found


def test_flower_shows_each_deliverys_true_state_and_no_maintenance_tasks(
    clean_acc: dict[str, str],
    spawn: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**clean_acc, "FLOWER_UNAUTHENTICATED_API": "true"}
    for key in (
        "OUTBOX_TEST_DATABASE_URL",
        "OUTBOX_TEST_SCHEMA",
        "OUTBOX_TEST_REDIS_URL",
        "OUTBOX_TEST_KEY_PREFIX",
    ):
        monkeypatch.setenv(key, env[key])
    port = free_port()
    app_arg = ["-m", "celery", "-A", "tests.apps.flower_app"]
    spawn(
        [sys.executable, *app_arg, "flower", "--address=127.0.0.1", f"--port={port}"], env, "flower"
    )
    worker = spawn(worker_with_beat("tests.apps.flower_app", tmp_path, "-E"), env, "worker")
    from tests.apps.flower_app import dispatcher

    # Flower up, and the worker's events reaching it (Redis keeps no event for a late
    # subscriber): a probe delivery shows in Flower before the test's rows are written
    deadline = time.monotonic() + 60
    while True:
        with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
            dispatcher.enqueue(conn, "fl.probe", {})
        time.sleep(0.5)
        try:
            if any(t.get("name") == "seen:fl.probe" for t in _tasks(port).values()):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, (tmp_path / "flower.log").read_text()[-2000:]
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]

    # a claim message that expired while no worker ran (as after a restart): never listed
    dispatcher.runtime.claim_task.apply_async(
        queue=dispatcher.claim_queue, expires=datetime.now(UTC) - timedelta(seconds=5)
    )
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        with conn.transaction():
            ids = {
                cmd: dispatcher.enqueue(conn, cmd, {}, actor=f"shop:{i}")
                for i, cmd in enumerate(["fl.ok", "fl.flaky", "fl.park", "fl.slow"])
            }
            batch = dispatcher.enqueue_many(conn, [Message("fl.batch", {}) for _ in range(30)])
        # the slow row is cancelled once it runs
        for _ in range(200):
            started = conn.execute(
                f'SELECT started_at FROM "{dispatcher.schema}".outbox WHERE id = %s',
                (ids["fl.slow"],),
            ).fetchone()
            if started and started[0] is not None:
                break
            time.sleep(0.05)
        with conn.transaction():
            dispatcher.cancel(conn, ids["fl.slow"], reason="customer left")
    # a message whose claim token is not the row's: dropped as stale
    forged = dispatcher.runtime.deliver_task.apply_async(
        (ids["fl.ok"], str(uuid.uuid4())), queue="outbox.seen", shadow="seen:fl.ok"
    )

    def by_name() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for task_id, t in _tasks(port).items():
            out.setdefault(str(t.get("name")), []).append({**t, "id": task_id})
        return out

    def states(name: str) -> list[str]:
        return sorted(str(t["state"]) for t in by_name().get(name, []))

    want = {
        "seen:fl.ok": ["STALE", "SUCCESS"],
        "seen:fl.flaky": ["RETRY", "SUCCESS"],
        "seen:fl.park": ["FAILURE"],
        "seen:fl.slow": ["REVOKED"],
    }

    def bulk_done() -> bool:
        ts = [t for n, ts in by_name().items() if n.startswith("bulk:fl.batch") for t in ts]
        ok = [t for t in ts if t["state"] == "SUCCESS"]
        return len(ok) == len(ts) and sum(len(_rows_of(t)) for t in ok) == len(batch)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(states(n) == s for n, s in want.items()) and bulk_done():
            break
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        time.sleep(0.3)
    seen = by_name()
    assert {n: states(n) for n in want} == want, (tmp_path / "worker.log").read_text()[-3000:]
    ok = next(t for t in seen["seen:fl.ok"] if t["state"] == "SUCCESS")
    assert ok["result"] == "'delivered'"
    assert ok["args"] == f"(row={ids['fl.ok']}, actor='shop:0', attempt=1)"
    # the handler's error and traceback, not the outbox's: where the handler failed
    retried = next(t for t in seen["seen:fl.flaky"] if t["state"] == "RETRY")
    assert retried["exception"] == "ConnectionError: provider down"
    assert "in flaky" in retried["traceback"]
    parked = seen["seen:fl.park"][0]
    assert parked["exception"].endswith("PermanentFailure: bad address")
    assert "in park" in parked["traceback"] and "wiring.py" not in parked["traceback"]
    stale = next(t for t in seen["seen:fl.ok"] if t["state"] == "STALE")
    assert stale["id"] == forged.id
    batched = [t for n, ts in seen.items() if n.startswith("bulk:fl.batch") for t in ts]
    assert batched and all(t["state"] == "SUCCESS" for t in batched)
    assert any(t["name"].endswith("]") for t in batched)  # a backlog: batched messages
    # each batched message's result lists its rows; a lone row's message is one of its own
    listed = [row for t in batched for row in _rows_of(t)]
    assert sorted(listed) == sorted(batch)
    assert not [n for n in seen if n.startswith("outbox.") or n in ("None", "")], sorted(seen)
    shots = os.environ.get("OUTBOX_SCREENSHOTS")  # scripts/screenshots, for the docs
    if shots:
        _screenshot_tasks(port, Path(shots) / "flower-tasks.png")


def _screenshot_tasks(port: int, path: Path) -> None:
    """Flower's task list, as an operator sees it (only when asked for: it needs Chromium)."""
    from selenium.webdriver.common.by import By

    from tests.support.browser import chrome

    with chrome() as browser:
        browser.set_window_size(1400, 1150)
        browser.get(f"http://127.0.0.1:{port}/tasks")
        deadline = time.monotonic() + 20
        while len(browser.find_elements(By.CSS_SELECTOR, "#tasks-table tbody tr")) < 5:
            assert time.monotonic() < deadline, "Flower's task table did not fill"
            time.sleep(0.2)
        time.sleep(0.5)
        browser.save_screenshot(str(path))


def _rows_of(task: dict[str, Any]) -> list[int]:
    """The rows a delivery message ran: a batched message's result ('delivered [1, 2]'), or a
    one-row message's args ('(row=3, ...)')."""
    text = str(task["result"]).strip("'\"")
    if text == "delivered":
        return [int(str(task["args"]).removeprefix("(row=").split(",")[0])]
    assert text.startswith("delivered ["), text
    rows: list[int] = json.loads(text.removeprefix("delivered "))
    return rows
