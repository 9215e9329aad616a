"""The least-privilege layout with real roles: the migrate role owns the schema and migrates it;
the runtime role runs every runtime path (enqueue, claim, deliver, settle, caps, cancel, cron,
prune, the NOTIFY listener) and cannot change the schema."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import (
    Backoff,
    ConfigurationError,
    Context,
    DatabaseError,
    Dispatcher,
    InvalidIdentifier,
    Message,
    Outcome,
)
from outbox_dispatch.claim.claimer import ClaimReport
from outbox_dispatch.store.migrations import latest_version, migrate
from outbox_dispatch.store.roles import apply_roles, role_sql

pytestmark = pytest.mark.usefixtures("clean")

REDIS_DB = 9


def as_role(url: str, role: str) -> str:
    """The test database's URL for another role (trust auth on 127.0.0.1)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@pytest.fixture
def layout(database_url: str) -> Iterator[tuple[str, str, str]]:
    """Two throwaway login roles and a schema name, all dropped at the end."""
    tag = uuid.uuid4().hex[:8]
    mig, run, schema = f"od_mig_{tag}", f"od_run_{tag}", f"od_roles_{tag}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{mig}" LOGIN')
        conn.execute(f'CREATE ROLE "{run}" LOGIN')
    yield mig, run, schema
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'DROP OWNED BY "{mig}", "{run}"')  # grants, default privileges
        conn.execute(f'DROP ROLE "{run}"')
        conn.execute(f'DROP ROLE "{mig}"')


# what the runtime role must not do to the schema ("S" is the schema)
DENIED_DDL = [
    "ALTER TABLE S.outbox ADD COLUMN evil text",
    "ALTER TABLE S.outbox DROP COLUMN payload",
    "DROP TABLE S.outbox",
    "TRUNCATE S.outbox",
    "CREATE TABLE S.evil (id int)",
    "CREATE INDEX evil ON S.outbox (command)",
    "CREATE FUNCTION S.evil() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE TRIGGER evil BEFORE UPDATE ON S.outbox FOR EACH ROW"
    " EXECUTE FUNCTION suppress_redundant_updates_trigger()",
    "ALTER SCHEMA S RENAME TO evil",
    "DROP SCHEMA S CASCADE",
]


def _owners(database_url: str, schema: str) -> set[str]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c"
            " WHERE c.relnamespace = %s::regnamespace",
            (f'"{schema}"',),
        ).fetchall()
    return {r[0] for r in rows}


def test_runtime_role_runs_every_runtime_path_and_cannot_change_the_schema(
    layout: tuple[str, str, str], database_url: str, redis_url: str
) -> None:
    mig, run, schema = layout
    applied = apply_roles(database_url, schema, migrate_role=mig, runtime_role=run)
    assert any("DEFAULT PRIVILEGES" in s for s in applied)
    assert migrate(as_role(database_url, mig), schema)[-1] == latest_version()
    assert _owners(database_url, schema) == {mig}

    # -- the runtime role: a producer, a worker and beat in one dispatcher -------------------
    caps_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    prefix = f"odroles{uuid.uuid4().hex[:8]}"
    runtime_url = as_role(database_url, run)
    app = Celery("roles", broker="memory://", set_as_current=False)
    d = Dispatcher(
        app,
        database_url=runtime_url,
        redis_url=caps_url,
        schema=schema,
        key_prefix=prefix,
        listen=False,
    )
    try:
        _exercise_runtime(d, runtime_url, schema)
    finally:
        d.close()
        client = redis.Redis.from_url(caps_url)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()

    # -- and it cannot change the schema --------------------------------------------------
    quoted = f'"{schema}"'
    for ddl in DENIED_DDL:
        with psycopg.connect(runtime_url, autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(
                    ddl.replace("S.", f"{quoted}.").replace("SCHEMA S", f"SCHEMA {quoted}")
                )
    with psycopg.connect(runtime_url, autocommit=True) as conn:  # only the owner records
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f'DELETE FROM "{schema}".outbox_migrations')
    with pytest.raises(DatabaseError, match="permission denied") as info:
        migrate(runtime_url, schema)
    assert isinstance(info.value.__cause__, psycopg.errors.InsufficientPrivilege)
    assert _owners(database_url, schema) == {mig}


def _exercise_runtime(d: Dispatcher, url: str, schema: str) -> None:
    d.family("plain", max_attempts=2, lease=5, backoff=Backoff(0.01, 0.01, 0.0), retention=0.05)
    d.family("capped", per_actor=1, lease=5)
    d.family("line", ordered=True, lease=5)
    ran: list[tuple[str, int]] = []

    def ok(ctx: Context, payload: Any) -> None:
        ran.append((ctx.command, ctx.row_id))
        ctx.heartbeat({"done": 1})  # renew the lease and store progress

    def fail(ctx: Context, payload: Any) -> None:
        raise RuntimeError("always")

    def in_txn(ctx: Context, payload: Any) -> None:
        ctx.conn.execute("SELECT 1")
        ran.append((ctx.command, ctx.row_id))

    for cmd, family in [("r.ok", "plain"), ("r.cap", "capped"), ("r.line", "line")]:
        d.handler(cmd, family=family)(ok)
    d.handler("r.fail", family="plain")(fail)
    d.handler("r.txn", family="plain", transactional=True)(in_txn)
    d.declare("r.later", family="plain")

    # the NOTIFY listener: advisory lock, LISTEN, and a claim when a commit notifies
    woke = threading.Event()
    listener = d.runtime.commit_listener()

    def woken(families: list[str] | None) -> ClaimReport:
        if families is not None:  # not the pass over every family when it starts listening
            woke.set()
        return ClaimReport()

    listener.claim = woken
    listener.start()
    try:
        assert listener.leading.wait(10), "the runtime role could not lead the listener"
        with psycopg.connect(url) as conn, conn.transaction():
            first = d.enqueue(conn, "r.ok", {"n": 1}, dedupe_key="roles-1")
            assert d.enqueue(conn, "r.ok", {"n": 2}, dedupe_key="roles-1") == first
            d.enqueue_many(
                conn,
                [Message("r.fail", {}), Message("r.txn", {})]
                + [Message("r.cap", {}, actor="A") for _ in range(2)]
                + [Message("r.line", {}, actor="L") for _ in range(2)],
            )
            gone = d.enqueue(conn, "r.later", {}, actor="x")
        assert woke.wait(10), "the runtime role's commit did not wake the listener"
    finally:
        listener.stop()
    with psycopg.connect(url) as conn, conn.transaction():
        assert d.cancel(conn, gone, reason="not needed", by="roles test").cancelled == [gone]

    assert d.claimer.rebuild_caps() == 0  # the caps rebuild reads live leases
    report = d.drain(timeout=20)  # claims (plain, capped, ordered), begins, settles
    assert report.delivered == 6 and report.count(Outcome.PARKED) == 1
    assert sorted(c for c, _ in ran) == sorted(["r.ok", "r.txn", "r.cap", "r.cap"] + ["r.line"] * 2)
    assert {s.family: s.parked for s in d.ops.status()}["plain"] == 1
    [parked] = d.store.parked_list()
    assert d.ops.parked_retry(ids=[parked["id"]]) == [parked["id"]]
    deadline = time.monotonic() + 10
    while not d.store.parked_list():  # it fails twice more and is parked again
        assert time.monotonic() < deadline, "the retried row was not parked again"
        d.drain(timeout=5)
        time.sleep(0.02)
    assert d.ops.parked_purge(family="plain") == [parked["id"]]

    name = f"roles-{uuid.uuid4().hex[:6]}"
    d.ops.cron(name, "* * * * * *", "r.ok", {"kind": "cron"}, catch_up="latest")
    d.ops.run_cron()  # creates the schedule's row
    time.sleep(1.1)
    assert d.ops.run_cron() == {name: 1}

    time.sleep(0.1)  # past the retention of the delivered rows
    assert sum(d.ops.prune().values()) >= 1


def test_a_migrate_role_that_only_owns_its_schema_can_migrate(
    layout: tuple[str, str, str], database_url: str
) -> None:
    mig, run, schema = layout
    apply_roles(database_url, schema, migrate_role=mig, runtime_role=run)
    assert migrate(as_role(database_url, mig), schema)[-1] == latest_version()


def test_layout_adopts_a_schema_migrated_by_another_role_and_covers_later_tables(
    layout: tuple[str, str, str], database_url: str
) -> None:
    mig, run, schema = layout
    migrate(database_url, schema)  # migrated before the layout, as the admin
    apply_roles(database_url, schema, migrate_role=mig, runtime_role=run)
    apply_roles(database_url, schema, migrate_role=mig, runtime_role=run)  # idempotent
    assert _owners(database_url, schema) == {mig}
    q = f'"{schema}"'
    with psycopg.connect(as_role(database_url, mig), autocommit=True) as conn:
        # a later migration, run by the migrate role, adds a table with an identity column
        conn.execute(f"CREATE TABLE {q}.later (id bigint GENERATED ALWAYS AS IDENTITY, x int)")
    with psycopg.connect(as_role(database_url, run), autocommit=True) as conn:
        row = conn.execute(f"INSERT INTO {q}.later (x) VALUES (1) RETURNING id").fetchone()
        assert row == (1,)
        conn.execute(f"UPDATE {q}.later SET x = 2")
        conn.execute(f"DELETE FROM {q}.later")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"ALTER TABLE {q}.later ADD COLUMN y int")


def test_role_sql_refuses_names_it_cannot_quote_safely() -> None:
    ok = role_sql("outbox", migrate_role="outbox-migrate", runtime_role="outbox_app")
    assert 'ALTER SCHEMA "outbox" OWNER TO "outbox-migrate"' in ok
    assert not any("CONNECT" in s for s in ok)  # no database named: no CONNECT grant
    bad: list[Callable[[], object]] = [
        lambda: role_sql('x"; DROP', migrate_role="m", runtime_role="r"),
        lambda: role_sql("outbox", migrate_role="m'; DROP ROLE x; --", runtime_role="r"),
        lambda: role_sql("outbox", migrate_role="m", runtime_role="r$$"),
        lambda: role_sql("outbox", migrate_role="m", runtime_role="r", database='d"x'),
        lambda: role_sql("outbox", migrate_role="", runtime_role="r"),
    ]
    for call in bad:
        with pytest.raises(InvalidIdentifier):
            call()
    with pytest.raises(ConfigurationError, match="must differ"):
        role_sql("outbox", migrate_role="same", runtime_role="same")


def test_apply_roles_names_the_roles_that_do_not_exist(database_url: str) -> None:
    missing = f"od_nobody_{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigurationError, match=rf"roles \['{missing}'\] do not exist"):
        apply_roles(database_url, "od_never", migrate_role="postgres", runtime_role=missing)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT to_regnamespace('od_never')").fetchone() == (None,)


def test_cli_prints_the_layout_and_applies_it(
    layout: tuple[str, str, str], database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from outbox_dispatch.ops.cli import main

    mig, run, schema = layout
    base = ["--json", "roles", "--migrate-role", mig, "--runtime-role", run]
    base += ["--database-url", database_url, "--schema", schema]
    assert main(base) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["statements"] == role_sql(schema, migrate_role=mig, runtime_role=run)
    assert printed["applied"] is False
    with psycopg.connect(database_url) as conn:  # printing changed nothing
        assert conn.execute("SELECT to_regnamespace(%s)", (schema,)).fetchone() == (None,)
    assert main([*base, "--apply"]) == 0
    assert json.loads(capsys.readouterr().out)["applied"] is True
    assert migrate(as_role(database_url, mig), schema)[-1] == latest_version()
    assert _owners(database_url, schema) == {mig}
