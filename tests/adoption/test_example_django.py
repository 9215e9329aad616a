"""examples/django_shop, run as its users run it: Django's migrate and outbox_migrate, a real
``celery -A djshop worker -B`` process (the app's ``task_cls=OutboxTask``, its
``@shared_task`` tasks unchanged), and orders placed through the project's view, one rolled
back. Every placed order is charged (after one ``self.retry``) and gets its receipt; the
rolled-back one leaves nothing. Processes of their own, since the suite's own Django settings
are set up in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import drop_run
from tests.fixtures.processes import ROOT, worker_with_beat

EXAMPLE = ROOT / "examples" / "django_shop"

PLACE = """
import json
from django.test import Client
client = Client()
codes = [client.post("/orders/", {"customer": f"c{i}", "cents": 100 * i}).status_code
         for i in range(1, 4)]
codes.append(client.post("/orders/", {"customer": "late", "cents": 1, "in_stock": "no"})
             .status_code)
print(json.dumps(codes))
"""


@pytest.fixture
def django_env(database_url: str, redis_url: str, run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_djshop_{run_id}"
    prefix = f"od_djshop_{run_id}:"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')  # Django's tables go here
    env = {
        **os.environ,
        "DJSHOP_DATABASE_URL": database_url,
        "DJSHOP_SCHEMA": schema,
        "DJSHOP_BROKER_URL": redis_url,
        "DJSHOP_KEY_PREFIX": prefix,
        "DJANGO_SETTINGS_MODULE": "djshop.settings",
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(ROOT)]),
        "PYTHONUNBUFFERED": "1",
    }
    yield env
    drop_run(database_url, schema, redis_url, prefix)


def _manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        env=env,
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_django_shop_moved_by_one_line_delivers_each_committed_order(
    django_env: dict[str, str], spawn: Callable[..., Any], tmp_path: Path
) -> None:
    _manage(django_env, "migrate", "--verbosity", "0")
    _manage(django_env, "outbox_migrate")
    worker = spawn(
        worker_with_beat("djshop", tmp_path),
        django_env,
        "django-worker",
        cwd=EXAMPLE,
    )
    codes = json.loads(_manage(django_env, "shell", "-c", PLACE).strip().splitlines()[-1])
    assert codes == [201, 201, 201, 409]
    schema = django_env["DJSHOP_SCHEMA"]

    def orders() -> list[tuple[str, int, bool, bool]]:
        with psycopg.connect(django_env["DJSHOP_DATABASE_URL"]) as conn:
            return [
                (r[0], int(r[1]), bool(r[2]), bool(r[3]))
                for r in conn.execute(
                    f"SELECT customer, charge_attempts, paid, receipt_sent"
                    f' FROM "{schema}".shop_order ORDER BY id'
                )
            ]

    want = [(f"c{i}", 2, True, True) for i in range(1, 4)]
    deadline = time.monotonic() + 60
    while orders() != want and time.monotonic() < deadline:
        assert worker.poll() is None, (tmp_path / "django-worker.log").read_text()[-3000:]
        time.sleep(0.3)
    assert orders() == want, (tmp_path / "django-worker.log").read_text()[-3000:]
    # the rolled-back order's calls never existed; the rest were delivered and settled (a
    # worker settles a delivered row within a few ms of its handler)
    deadline = time.monotonic() + 10
    while True:
        with psycopg.connect(django_env["DJSHOP_DATABASE_URL"]) as conn:
            left = conn.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()
        if left == (0,) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == (0,)
