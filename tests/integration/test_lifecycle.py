"""Job lifecycle in one process: heartbeats, cancellation, transactional handlers, lost
attempts, retention and pruning, durable cron."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import (
    Backoff,
    ConfigurationError,
    Context,
    Dispatcher,
    InvalidArgument,
    InvalidPayload,
    MaintenanceFailed,
    Outcome,
)
from outbox_dispatch.core.cron import CatchUp, due_ticks
from tests.conftest import count_rows


@pytest.fixture(scope="module")
def life(database_url: str, schema: str) -> Iterator[Dispatcher]:
    app = Celery("life_tests", broker="memory://", set_as_current=False)
    d = Dispatcher(app, database_url=database_url, schema=schema)
    d.family(
        "short", lease=1.0, heartbeat_timeout=1.0, max_attempts=3, backoff=Backoff(0.01, 0.01, 0)
    )
    d.family("kept", lease=30, retention=3600)
    d.family("gone", lease=30, retention=0)
    d.family("fragile", lease=30, max_attempts=5, on_lost="park")
    d.family("line", lease=30, ordered=True)
    yield d
    d.close()


def _name() -> str:
    return f"l.{uuid.uuid4().hex[:8]}"


def _one(d: Dispatcher, url: str, cmd: str, payload: Any = None, **kw: Any) -> int:
    with psycopg.connect(url) as conn, conn.transaction():
        return d.enqueue(conn, cmd, payload if payload is not None else {}, **kw)


def _row(url: str, schema: str, row_id: int) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        found = cur.execute(f'SELECT * FROM "{schema}".outbox WHERE id = %s', (row_id,)).fetchone()
    assert found is not None
    return found


def _deliver_while_a_rival_claims(life: Dispatcher, row_id: int) -> list[int]:
    """Deliver ``row_id`` (family ``short``) while another claimer tries every 0.1 s to take
    the family's rows, which it gets only if their lease lapsed; the rows it took."""
    stolen: list[int] = []
    stop = threading.Event()

    def rival() -> None:
        while not stop.is_set():
            stolen.extend(c.id for c in life.claimer.claim_family(life.families["short"]).claimed)
            time.sleep(0.1)

    result = life.claimer.claim_family(life.families["short"])
    t = threading.Thread(target=rival)
    t.start()
    try:
        assert life.delivery.deliver(row_id, result.claimed[0].token).outcome is Outcome.DELIVERED
    finally:
        stop.set()
        t.join()
    return stolen


def test_heartbeat_keeps_a_long_handler_from_being_claimed_again(
    life: Dispatcher, database_url: str
) -> None:
    runs: list[int] = []
    cmd = _name()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: renewed every 0.33 s
    def slow(ctx: Context, payload: Any) -> None:
        runs.append(ctx.attempt)
        time.sleep(2.5)

    row_id = _one(life, database_url, cmd)
    assert _deliver_while_a_rival_claims(life, row_id) == []
    assert runs == [1]


def test_progress_is_recorded_by_ctx_heartbeat(life: Dispatcher, database_url: str) -> None:
    cmd = _name()
    seen: list[Any] = []

    @life.handler(cmd, family="kept")
    def report(ctx: Context, payload: Any) -> None:
        assert ctx.heartbeat({"done": 5, "of": 10})
        seen.append(_row(database_url, life.schema, ctx.row_id)["progress"])

    _one(life, database_url, cmd)
    life.drain(timeout=5)
    assert seen == [{"done": 5, "of": 10}]


def test_progress_that_is_not_json_is_refused_at_the_call_and_the_lease_still_renews(
    life: Dispatcher, database_url: str
) -> None:
    """A handler passes ctx.heartbeat a progress value jsonb cannot hold (an object, NaN).
    The call raises InvalidPayload saying so, the row's progress is left as it was, and the
    lease goes on being renewed: the value once stayed on the heartbeat's entry and every
    later renewal failed on it (an object ended the heartbeat thread; NaN failed in
    Postgres, tick after tick), and the row was claimed again while its handler still ran."""
    runs: list[int] = []
    errors: list[str] = []
    seen: list[Any] = []
    cmd = _name()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: renewed every 0.33 s
    def slow(ctx: Context, payload: Any) -> None:
        runs.append(ctx.attempt)
        progress: dict[str, Any] = {"done": 1}
        assert ctx.heartbeat(progress)
        progress["rate"] = math.nan  # changed after the call: the renewals send what it was
        for bad in ({"at": object()}, {"rate": math.nan}):
            with pytest.raises(InvalidPayload) as raised:
                ctx.heartbeat(bad)
            errors.append(str(raised.value))
        seen.append(_row(database_url, life.schema, ctx.row_id)["progress"])
        time.sleep(2.5)

    row_id = _one(life, database_url, cmd)
    assert _deliver_while_a_rival_claims(life, row_id) == []
    assert runs == [1]
    assert len(errors) == 2, errors
    assert all("heartbeat progress" in e and "JSON" in e for e in errors), errors
    assert seen == [{"done": 1}]


def test_cancel_pending_rows_by_id_dedupe_key_and_actor(
    life: Dispatcher, database_url: str
) -> None:
    cmd, other = _name(), _name()
    ran: list[int] = []
    life.handler(cmd, family="kept")(lambda ctx, p: ran.append(ctx.row_id))
    life.handler(other, family="kept")(lambda ctx, p: ran.append(ctx.row_id))
    a = _one(life, database_url, cmd)
    b = _one(life, database_url, cmd, dedupe_key="order:7")
    c = _one(life, database_url, cmd, actor="user:1")
    d = _one(life, database_url, cmd, actor="user:1")
    e = _one(life, database_url, other, actor="user:1")
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, a, reason="customer left", by="ops").cancelled == [a]
        assert life.cancel(conn, dedupe_key="order:7").cancelled == [b]
        assert life.cancel(conn, actor="user:1", command=cmd).cancelled == [c, d]
        with pytest.raises(InvalidArgument):
            life.cancel(conn)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(psycopg.errors.Error), conn.transaction():  # rolled back: no cancel
            life.cancel(conn, e)
            conn.execute("SELECT 1/0")
    life.drain(timeout=5)
    assert ran == [e]
    row = _row(database_url, life.schema, a)
    assert row["cancelled_at"] is not None
    assert (row["cancel_reason"], row["cancelled_by"]) == ("customer left", "ops")
    status = {s.family: s for s in life.ops.status()}["kept"]
    assert status.cancelled == 4


def test_cancel_reaches_a_running_handler_within_one_heartbeat(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    stopped: list[float] = []
    started = threading.Event()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: every ~0.33 s
    def loop(ctx: Context, payload: Any) -> None:
        started.set()
        deadline = time.monotonic() + 10
        while not ctx.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(time.monotonic())

    row_id = _one(life, database_url, cmd)
    reports: list[Any] = []
    t = threading.Thread(target=lambda: reports.append(life.drain(timeout=15)))
    t.start()
    assert started.wait(5)
    with psycopg.connect(database_url) as conn, conn.transaction():
        asked = life.cancel(conn, row_id, reason="stop it")
    cancelled_at = time.monotonic()
    assert asked.requested == [row_id] and asked.cancelled == []
    t.join(15)
    assert reports[0].count(Outcome.CANCELLED) == 1
    assert stopped and stopped[0] - cancelled_at < 1.0 / 3 + 0.35  # one heartbeat + a tick
    row = _row(database_url, life.schema, row_id)
    assert row["cancelled_at"] is not None and row["cancel_reason"] == "stop it"
    assert row["claim_token"] is None


def test_row_cancelled_while_its_message_travels_never_runs(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    ran: list[int] = []
    life.handler(cmd, family="kept")(lambda ctx, p: ran.append(1))
    row_id = _one(life, database_url, cmd)
    claimed = life.claimer.claim_family(life.families["kept"]).claimed[0]
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, row_id).requested == [row_id]  # claimed: the holder settles
    assert life.delivery.deliver(row_id, claimed.token).outcome is Outcome.CANCELLED
    assert ran == []
    assert _row(database_url, life.schema, row_id)["cancelled_at"] is not None


def test_cancelling_an_ordered_head_lets_the_next_row_run(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    ran: list[int] = []
    life.handler(cmd, family="line")(lambda ctx, p: ran.append(p["n"]))
    first = _one(life, database_url, cmd, {"n": 0}, actor="L", delay=timedelta(hours=1))
    _one(life, database_url, cmd, {"n": 1}, actor="L")
    life.drain(timeout=5)
    assert ran == []  # the delayed head holds the line
    with psycopg.connect(database_url) as conn, conn.transaction():
        life.cancel(conn, first)
    life.drain(timeout=5)
    assert ran == [1]


def _effects_table(url: str, schema: str) -> str:
    name = f'"{schema}".effects_{uuid.uuid4().hex[:6]}'
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (row_id bigint, note text)")
    return name


def test_transactional_handler_commits_its_writes_with_the_settle(
    life: Dispatcher, database_url: str
) -> None:
    table = _effects_table(database_url, life.schema)
    cmd = _name()

    @life.handler(cmd, family="short", transactional=True)
    def write(ctx: Context, payload: Any) -> None:
        note = f"{payload['note']} from attempt {ctx.attempt}"
        ctx.conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (ctx.row_id, note))
        if ctx.attempt == 1:
            raise RuntimeError("after writing: the write must roll back")

    row_id = _one(life, database_url, cmd, {"note": "hello"})
    report = life.drain(timeout=5)  # the retry may run in the same drain: its backoff is short
    while not report.delivered:
        time.sleep(0.05)
        report = life.drain(timeout=5)
    with psycopg.connect(database_url) as conn:
        effects = conn.execute(f"SELECT row_id, note FROM {table}").fetchall()
    assert effects == [(row_id, "hello from attempt 2")]  # attempt 1's write rolled back
    assert count_rows(database_url, life.schema, f"id = {row_id}") == 0


def test_transactional_handler_cancelled_mid_run_rolls_its_writes_back(
    life: Dispatcher, database_url: str
) -> None:
    table = _effects_table(database_url, life.schema)
    cmd = _name()
    go = threading.Event()

    @life.handler(cmd, family="kept", transactional=True)
    def write(ctx: Context, payload: Any) -> None:
        ctx.conn.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (ctx.row_id,))
        go.set()
        time.sleep(0.5)  # the cancel arrives now; the row is locked, so it is a request

    row_id = _one(life, database_url, cmd)
    t = threading.Thread(target=lambda: life.drain(timeout=10))
    t.start()
    assert go.wait(5)
    with psycopg.connect(database_url) as conn, conn.transaction():
        assert life.cancel(conn, row_id).requested == [row_id]
    t.join(10)
    with psycopg.connect(database_url) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    assert _row(database_url, life.schema, row_id)["cancelled_at"] is not None


def test_lost_attempt_parks_when_the_family_says_so(life: Dispatcher, database_url: str) -> None:
    cmd = _name()
    life.handler(cmd, family="fragile")(lambda ctx, p: None)
    row_id = _one(life, database_url, cmd)
    claimed = life.claimer.claim_family(life.families["fragile"]).claimed[0]
    assert life.store.begin(row_id, claimed.token, 30) is not None  # started, then its worker died
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{life.schema}".outbox SET due_at = now() WHERE id = %s', (row_id,))
    result = life.claimer.claim_family(life.families["fragile"])
    assert result.parked == [row_id]
    row = _row(database_url, life.schema, row_id)
    assert row["maybe_applied"] and "ended without an outcome" in row["last_error"]


def test_retention_keeps_dedupe_keys_and_prune_deletes_only_expired_rows_in_batches(
    life: Dispatcher, database_url: str
) -> None:
    cmd, brief = _name(), _name()
    life.handler(cmd, family="kept")(lambda ctx, p: None)
    life.handler(brief, family="gone")(lambda ctx, p: None)
    first = _one(life, database_url, cmd, dedupe_key="kept:1")
    life.drain(timeout=5)
    assert _row(database_url, life.schema, first)["done_at"] is not None
    assert _one(life, database_url, cmd, dedupe_key="kept:1") == first  # still deduplicated
    ids = [_one(life, database_url, cmd) for _ in range(7)]
    life.drain(timeout=5)
    with psycopg.connect(database_url, autocommit=True) as conn:  # 5 of them are 2 hours old
        conn.execute(
            f"UPDATE \"{life.schema}\".outbox SET done_at = now() - interval '2 hours'"
            " WHERE id = ANY(%s)",
            (ids[:5],),
        )
    calls: list[int] = []
    real = life.store.prune

    def spy(family: str, retention: float, batch: int) -> int:
        n = real(family, retention, batch)
        calls.append(n)
        return n

    life.store.prune = spy  # type: ignore[method-assign]
    try:
        assert life.ops.prune(batch=2) == {"kept": 5}
    finally:
        life.store.prune = real  # type: ignore[method-assign]
    assert [n for n in calls if n] == [2, 2, 1]  # batches of at most 2 rows
    left = count_rows(database_url, life.schema, f"id = ANY(ARRAY{[first, *ids]})")
    assert left == 3  # the recent ones stay


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


def test_a_handler_that_kills_its_worker_every_time_is_parked_even_in_intent(
    life: Dispatcher, database_url: str
) -> None:
    cmd = _name()
    life.handler(cmd, family="intent")(lambda ctx, p: None)  # intent retries forever
    row_id = _one(life, database_url, cmd)
    fam = life.families["intent"]
    for _ in range(fam.max_lost + 1):  # max_lost attempts start and die; the next claim parks
        result = life.claimer.claim_family(fam)
        if result.parked:
            break
        claimed = next(c for c in result.claimed if c.id == row_id)
        assert life.store.begin(row_id, claimed.token, 30) is not None  # ...and dies
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                f'UPDATE "{life.schema}".outbox SET due_at = now() WHERE id = %s', (row_id,)
            )
    row = _row(database_url, life.schema, row_id)
    assert row["parked_at"] is not None
    assert row["lost_attempts"] == fam.max_lost
