"""Durable cron in one process: ticks follow the catch-up policy, two schedulers write one row
per tick, and a schedule that could never fire is refused without stopping the others."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import ConfigurationError, Dispatcher, InvalidArgument, MaintenanceFailed
from outbox_dispatch.core.cron import CatchUp, due_ticks
from tests.support.lifecycle import (
    _name,
    life_dispatcher,  # noqa: F401 (the fixture life)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_cron_ticks_are_pure_and_follow_the_catch_up_policy() -> None:
    t0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    every2 = "* * * * * */2"
    later = t0 + timedelta(seconds=7)
    assert due_ticks(every2, "UTC", t0, later, CatchUp.ALL, timedelta(hours=1)) == [
        t0 + timedelta(seconds=s) for s in (2, 4, 6)
    ]
    assert due_ticks(every2, "UTC", t0, later, CatchUp.LATEST, timedelta(hours=1)) == [
        t0 + timedelta(seconds=6)
    ]
    assert due_ticks(every2, "UTC", t0, later, CatchUp.ALL, timedelta(seconds=3)) == [
        t0 + timedelta(seconds=6)
    ]
    assert due_ticks(every2, "UTC", t0, t0 + timedelta(seconds=1), CatchUp.ALL, timedelta(1)) == []
    # 09:00 in Paris is 08:00 UTC in winter and 07:00 UTC in summer
    spring = datetime(2026, 3, 28, 12, tzinfo=UTC)
    ticks = due_ticks(
        "0 9 * * *",
        "Europe/Paris",
        spring,
        spring + timedelta(days=2),
        CatchUp.ALL,
        timedelta(days=3),
    )
    assert [t.astimezone(UTC).hour for t in ticks] == [7, 7]


def test_cron_writes_one_row_per_tick_from_two_schedulers(
    life: Dispatcher, database_url: str, schema: str
) -> None:
    cmd = _name()
    life.handler(cmd, family="gone")(lambda ctx, p: None)
    app2 = Celery("other_beat", broker="memory://", set_as_current=False)
    other = Dispatcher(app2, database_url=database_url, schema=schema)  # a second beat process
    other.family("gone", lease=30)
    other.declare(cmd, family="gone")
    name = f"every2s-{uuid.uuid4().hex[:6]}"
    for d in (life, other):
        d.ops.cron(name, "* * * * * */2", cmd, {"kind": "report"}, catch_up="all")
    t0 = datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)
    for d in (life, other):
        assert d.ops.run_cron(now=t0) == {}  # a new schedule starts with its next tick
    for step in range(1, 6):  # five ticks, both schedulers run at every step
        now = t0 + timedelta(seconds=2 * step)
        written = [d.ops.run_cron(now=now).get(name, 0) for d in (life, other)]
        assert sorted(written) == [0, 1]
    with psycopg.connect(database_url) as conn:
        keys = conn.execute(
            f'SELECT dedupe_key, payload FROM "{schema}".outbox WHERE command = %s ORDER BY id',
            (cmd,),
        ).fetchall()
    assert len(keys) == 5
    assert keys[0][1] == {"kind": "report", "cron_tick": "2026-03-01T12:00:02+00:00"}
    # delivered rows are deleted, yet a late scheduler does not write their ticks again
    life.drain(timeout=5)
    assert other.ops.run_cron(now=t0 + timedelta(seconds=10)) == {}
    # a gap of three ticks: "all" writes each of them, "latest" only the last one
    latest = f"latest-{uuid.uuid4().hex[:6]}"
    life.ops.cron(latest, "* * * * * */2", cmd, {"kind": "latest"}, catch_up="latest")
    assert life.ops.run_cron(now=t0 + timedelta(seconds=10)) == {}
    assert life.ops.run_cron(now=t0 + timedelta(seconds=16)) == {name: 3, latest: 1}
    other.close()


def test_cron_refuses_what_could_never_fire_and_one_schedule_cannot_stop_the_others(
    life: Dispatcher, database_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule that names no date ('0 0 30 2 *') once passed the declaration and made
    every run_cron raise, so every other schedule stopped too; a bad window or check_every
    never fired; a second schedule of the same name silently replaced the first, and one of
    them lost its ticks. Each is refused when declared, and a schedule that fails at run
    time (its database statement, here) is logged while the others' ticks are written."""
    cmd = _name()
    life.handler(cmd, family="gone")(lambda ctx, p: None)
    tag = uuid.uuid4().hex[:6]
    for expr in ("0 0 30 2 *", "0 0 31 4 *"):
        with pytest.raises(ConfigurationError, match="names no date"):
            life.ops.cron(f"never-{tag}", expr, cmd, {})
    for window in (timedelta(hours=-1), 3600, timedelta(0)):
        with pytest.raises(ConfigurationError, match="window"):
            life.ops.cron(f"win-{tag}", "* * * * *", cmd, {}, catch_up="all", window=window)  # type: ignore[arg-type]
    for every in (0, -1, math.nan, "1"):
        with pytest.raises(ConfigurationError, match="check_every"):
            life.ops.cron(f"every-{tag}", "* * * * *", cmd, {}, check_every=every)  # type: ignore[arg-type]
    life.ops.cron(f"dup-{tag}", "* * * * *", cmd, {"n": 1})
    life.ops.cron(f"dup-{tag}", "* * * * *", cmd, {"n": 1})  # the same again: an import twice
    with pytest.raises(ConfigurationError, match="already declared"):
        life.ops.cron(f"dup-{tag}", "*/5 * * * *", cmd, {"n": 1})
    broken, fine = f"broken-{tag}", f"fine-{tag}"
    for name in (broken, fine):
        life.ops.cron(name, "* * * * * */2", cmd, {"name": name}, catch_up="all")
    ticks = life.database().maintenance.store.cron_ticks

    def fails_for_one(conn: Any, schedule: Any, now: Any) -> Any:
        if schedule.name == broken:
            raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
        return ticks(conn, schedule, now)

    t0 = datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)
    life.ops.run_cron(now=t0)  # new schedules start with their next tick
    monkeypatch.setattr(life.database().maintenance.store, "cron_ticks", fails_for_one)
    with pytest.raises(MaintenanceFailed, match=broken):
        life.ops.run_cron(now=t0 + timedelta(seconds=4))
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            f"SELECT payload->>'name' FROM \"{schema}\".outbox WHERE command = %s", (cmd,)
        ).fetchall()
    assert rows == [(fine,), (fine,)]  # the other schedule's two ticks were written
    for name in (broken, fine, f"dup-{tag}"):
        del life.ops.schedules[name]  # the module's dispatcher lives on: leave no schedule behind
    with pytest.raises(InvalidArgument, match="batch"):
        life.ops.prune(batch=-5)  # it reached Postgres, and every family's prune failed
    with pytest.raises(InvalidArgument, match="batch"):
        life.ops.prune(batch=1.5)  # type: ignore[arg-type]
