"""One Dispatcher over several real Postgres databases: the session's test database and two
created for this run (``od_mdb_<run>_<n>``), each with the session's outbox schema.

Rows go to the database of the caller's connection, messages name their database, caps stay
global over databases and are rebuilt from all of them, ordered lines are per (database,
actor), and a database that is cut (the fault proxy) stops only its own rows.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Context, Dispatcher, PermanentFailure
from outbox_dispatch.core.errors import ConfigurationError, UnknownDatabase
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.ops.cli import main as cli_main
from tests.conftest import count_rows
from tests.support.databases import url_of
from tests.support.faultproxy import FaultProxy

pytestmark = pytest.mark.usefixtures("clean")


def _enqueue(d: Dispatcher, url: str, command: str, n: int = 1, **kw: Any) -> list[int]:
    with psycopg.connect(url) as conn, conn.transaction():
        return [d.enqueue(conn, command, {"n": i}, **kw) for i in range(n)]


def _seen(d: Dispatcher, family: str = "intent") -> list[tuple[str, int, str | None]]:
    """Register a recording handler; returns the (database, row id, actor) list it fills."""
    seen: list[tuple[str, int, str | None]] = []

    @d.handler("mdb.record", family=family)
    def record(ctx: Context, payload: Any) -> None:
        seen.append((ctx.database, ctx.row_id, ctx.actor))

    return seen


def test_rows_go_to_the_database_of_the_connection(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str], schema: str
) -> None:
    d = make_dispatcher()
    seen = _seen(d)
    for name, url in shard_urls.items():
        _enqueue(d, url, "mdb.record", 2 if name == "eu" else 1)
    counts = {name: count_rows(url, schema) for name, url in shard_urls.items()}
    assert counts == {"main": 1, "eu": 2, "us": 1}
    report = d.drain(timeout=20)
    assert report.delivered == 4
    assert sorted(db for db, _, _ in seen) == ["eu", "eu", "main", "us"]
    assert all(count_rows(url, schema) == 0 for url in shard_urls.values())
    assert [s.database for s in d.ops.status() if s.family == "intent"] == ["main", "eu", "us"]


def test_sqlalchemy_and_the_localhost_spelling_find_their_database(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str], schema: str
) -> None:
    """A session bound to the eu database (reached as localhost, not 127.0.0.1) writes there."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    d = make_dispatcher()
    d.declare("mdb.orm")
    url = shard_urls["eu"].replace("postgresql://", "postgresql+psycopg://")
    engine = sqlalchemy.create_engine(url.replace("127.0.0.1", "localhost"))
    try:
        with Session(engine) as session, session.begin():
            d.enqueue(session, "mdb.orm", {"x": 1})
    finally:
        engine.dispose()
    assert count_rows(shard_urls["eu"], schema) == 1
    assert count_rows(shard_urls["main"], schema) == 0


def test_a_connection_to_another_database_is_refused_and_writes_nothing(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    database_url: str,
    schema: str,
) -> None:
    d = make_dispatcher()
    d.declare("mdb.refused")
    with psycopg.connect(url_of(database_url, "postgres")) as conn:
        with pytest.raises(UnknownDatabase, match="none of this dispatcher's databases"):
            d.enqueue(conn, "mdb.refused")
    with psycopg.connect(shard_urls["eu"]) as conn:
        with pytest.raises(UnknownDatabase, match="is to database 'eu', not 'us'"):
            d.enqueue(conn, "mdb.refused", database="us")
        with pytest.raises(UnknownDatabase, match="no database 'moon'"):
            d.enqueue(conn, "mdb.refused", database="moon")
    # eu's database by another address (a proxy, an IP for the host name): not taken for eu
    # on its name alone, but written there when the caller says so
    with FaultProxy(5432) as proxy, psycopg.connect(proxy.url(shard_urls["eu"])) as conn:
        with pytest.raises(UnknownDatabase, match="pass database= when a proxy hides"):
            d.enqueue(conn, "mdb.refused")
        conn.rollback()
        with conn.transaction():
            d.enqueue(conn, "mdb.refused", database="eu")
    assert count_rows(shard_urls["eu"], schema) == 1
    assert count_rows(shard_urls["main"], schema) == count_rows(shard_urls["us"], schema) == 0


def test_configuration_is_checked(shard_urls: dict[str, str], redis_url: str) -> None:
    app = Celery("mdb-config", broker=redis_url, set_as_current=False)
    with pytest.raises(ConfigurationError, match="not both"):
        Dispatcher(app, database_url=shard_urls["main"], databases=shard_urls)
    with pytest.raises(ConfigurationError, match="not valid"):
        Dispatcher(app, databases={"EU": shard_urls["eu"]})
    same = shard_urls["eu"].replace("127.0.0.1", "localhost")
    with pytest.raises(ConfigurationError, match="are the same database"):
        Dispatcher(app, databases={"a": shard_urls["eu"], "b": same})


def test_messages_name_their_database_and_a_forged_name_is_stale(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    published: list[dict[str, Any]],
) -> None:
    d = make_dispatcher()
    _seen(d)
    main_id = _enqueue(d, shard_urls["main"], "mdb.record")[0]
    eu_id = _enqueue(d, shard_urls["eu"], "mdb.record")[0]
    d.runtime.claim_and_publish()
    bodies = {tuple(p["body"][0][:-1]) for p in published}  # args without the token
    assert bodies == {(main_id,), ("eu", eu_id)}  # the first database's shape is unchanged
    shown = {p["headers"]["argsrepr"] for p in published}
    assert f"(database='eu', row={eu_id}, actor=None, attempt=1)" in shown
    token = next(p["body"][0][-1] for p in published if p["body"][0][0] == "eu")
    # the same row id and token under a database that does not exist, or another one
    for forged in (("moon", eu_id, token), ("us", eu_id, token)):
        results = d.runtime.deliver_from_queue(forged, "outbox.intent")
        assert [r.outcome for r in results] == [Outcome.STALE]
    (ok,) = d.runtime.deliver_from_queue(("eu", eu_id, token), "outbox.intent")
    assert ok.outcome is Outcome.DELIVERED


def test_caps_are_global_over_databases(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str], schema: str
) -> None:
    """cap 1: actor A's rows in two databases run one at a time; a settle in one database
    lets the other database's waiting row in at its next claim."""
    d = make_dispatcher()
    d.family("capped", per_actor=1, lease=30)
    _seen(d, family="capped")
    _enqueue(d, shard_urls["main"], "mdb.record", actor="A")
    _enqueue(d, shard_urls["eu"], "mdb.record", actor="A")
    first = d.database("main").claimer.claim_family(d.families["capped"])
    second = d.database("eu").claimer.claim_family(d.families["capped"])
    assert (len(first.claimed), len(second.claimed), second.waiting) == (1, 0, 1)
    (row,) = first.claimed
    assert d.database("main").delivery.deliver(row.id, row.token).outcome is Outcome.DELIVERED
    again = d.database("eu").claimer.claim_family(d.families["capped"])
    assert len(again.claimed) == 1  # promoted by the freed note, not after its 30 s lease


def test_a_caps_rebuild_reads_every_database(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str], redis_url: str
) -> None:
    d = make_dispatcher()
    d.family("capped", per_actor=1, lease=30)
    _seen(d, family="capped")
    _enqueue(d, shard_urls["main"], "mdb.record", actor="A")
    _enqueue(d, shard_urls["us"], "mdb.record", actor="B")
    d.database("main").claimer.claim_family(d.families["capped"])
    d.database("us").claimer.claim_family(d.families["capped"])
    assert d.caps is not None
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{d.caps.prefix}:ca*"):
        client.delete(key)  # Redis lost the semaphores and the sentinel
    client.close()
    # the next capped claim rebuilds: both holders, from both databases, are back
    _enqueue(d, shard_urls["eu"], "mdb.record", actor="B")
    blocked = d.database("eu").claimer.claim_family(d.families["capped"])
    assert (len(blocked.claimed), blocked.waiting) == (0, 1)  # B's slot is held in us
    assert len(d.caps.holders("capped", "A")) == 1
    assert len(d.caps.holders("capped", "B")) == 1


def test_ordered_lines_are_per_database_and_actor(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str]
) -> None:
    d = make_dispatcher()
    d.family("line", ordered=True)
    _seen(d, family="line")
    main = _enqueue(d, shard_urls["main"], "mdb.record", 2, actor="A")
    eu = _enqueue(d, shard_urls["eu"], "mdb.record", 2, actor="A")
    heads = [
        [c.id for c in d.database(n).claimer.claim_family(d.families["line"]).claimed]
        for n in ("main", "eu")
    ]
    assert heads == [[main[0]], [eu[0]]]  # each database's line has its own head


def test_operators_see_every_database_and_name_one_for_row_ids(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d = make_dispatcher()

    @d.handler("mdb.broken")
    def broken(ctx: Context, payload: Any) -> None:
        raise PermanentFailure(f"bad payload in {ctx.database}")

    _enqueue(d, shard_urls["main"], "mdb.broken")
    (eu_row,) = _enqueue(d, shard_urls["eu"], "mdb.broken")
    d.drain(timeout=10)
    spec = "tests.support.app_ref:dispatcher"
    monkeypatch.setattr("tests.support.app_ref.dispatcher", d, raising=False)

    assert cli_main(["--app", spec, "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    parked = {(s["database"], s["family"]): s["parked"] for s in status}
    assert (parked[("main", "intent")], parked[("eu", "intent")], parked[("us", "intent")]) == (
        1,
        1,
        0,
    )
    assert cli_main(["--app", spec, "status", "--database", "eu", "--json"]) == 0
    assert {s["database"] for s in json.loads(capsys.readouterr().out)} == {"eu"}

    assert cli_main(["--app", spec, "parked", "list"]) == 0
    shown = capsys.readouterr().out
    assert "bad payload in main" in shown and "bad payload in eu" in shown
    # a row id means a row of one database: without --database it is refused, nothing done
    assert cli_main(["--app", spec, "parked", "purge", str(eu_row)]) == 2
    assert "name the database" in capsys.readouterr().err
    assert count_rows(shard_urls["eu"], schema) == 1
    assert cli_main(["--app", spec, "parked", "purge", "--database", "eu", str(eu_row)]) == 0
    assert "1 row deleted" in capsys.readouterr().out
    assert count_rows(shard_urls["eu"], schema) == 0
    assert count_rows(shard_urls["main"], schema) == 1
    assert cli_main(["--app", spec, "parked", "list", "--database", "moon"]) == 2
    assert "no database 'moon'" in capsys.readouterr().err


def test_status_shows_the_databases_that_answer_and_names_the_one_that_does_not(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gone = url_of(database_url, f"od_mdb_gone_{uuid.uuid4().hex[:6]}")
    d = make_dispatcher({"main": shard_urls["main"], "gone": gone})
    monkeypatch.setattr("tests.support.app_ref.dispatcher", d, raising=False)
    spec = "tests.support.app_ref:dispatcher"
    assert cli_main(["--app", spec, "status", "--json"]) == 1
    out = capsys.readouterr()
    assert {s["database"] for s in json.loads(out.out)} == {"main"}
    assert "cannot reach the outbox database 'gone'" in out.err
    assert "does not exist" in out.err


def test_max_in_flight_holds_per_database(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str]
) -> None:
    """The family's broker queue is shared, its in-flight limit is each database's: the first
    database to claim does not take the others' room."""
    d = make_dispatcher()
    d.family("room", max_in_flight=10, batch=1)
    _seen(d, family="room")
    for name in ("main", "eu"):
        _enqueue(d, shard_urls[name], "mdb.record", 15)
    for _ in range(2):
        d.runtime.claim_and_publish(["room"])
    in_flight = {s.database: s.in_flight for s in d.ops.status() if s.family == "room"}
    assert in_flight == {"main": 10, "eu": 10, "us": 0}


def test_the_outbox_page_covers_every_database_and_acts_on_the_row_of_the_one_named(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str], schema: str
) -> None:
    from outbox_dispatch.ops.web import WebApp
    from tests.operations.test_web import call

    d = make_dispatcher()

    @d.handler("mdb.web")
    def broken(ctx: Context, payload: Any) -> None:
        raise PermanentFailure(f"down in {ctx.database}")

    _enqueue(d, shard_urls["main"], "mdb.web")
    (us_row,) = _enqueue(d, shard_urls["us"], "mdb.web")
    d.drain(timeout=10)
    web = WebApp(d, user="ops", password="s3cret")
    status, _, page = call(web, "GET", "/")
    assert status.startswith("200") and "<th>database</th>" in page and ">us<" in page
    _, _, parked = call(web, "GET", "/parked")
    assert "down in main" in parked and "down in us" in parked
    assert 'name="db" value="us"' in parked
    _, _, found = call(web, "GET", "/rows", query=f"q={us_row}&db=us")
    assert f"row {us_row} in us" in found
    status, headers, _ = call(
        web, "POST", "/purge", form={"token": web.token(), "id": us_row, "db": "us"}
    )
    assert status.startswith("303") and "db=us" in headers["Location"]
    assert count_rows(shard_urls["us"], schema) == 0
    assert count_rows(shard_urls["main"], schema) == 1  # its row of the same command stays
    _, _, refused = call(web, "GET", "/parked", query="db=moon")
    assert "no database &#x27;moon&#x27; here" in refused or "no database 'moon' here" in refused


def test_a_caps_rebuild_that_needs_a_down_database_holds_back_only_capped_rows(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    database_url: str,
    redis_url: str,
    schema: str,
) -> None:
    """Redis lost the semaphores while a database is down: the rebuild cannot be complete, so
    capped rows wait; the plain rows of the databases that answer are claimed, and the pass
    does not wait out the pool's timeout."""
    gone = url_of(database_url, f"od_mdb_gone_{uuid.uuid4().hex[:6]}")
    d = make_dispatcher({"main": shard_urls["main"], "gone": gone})
    d.family("capped", per_actor=1)
    _seen(d, family="capped")
    d.declare("mdb.plain")
    _enqueue(d, shard_urls["main"], "mdb.record", actor="A")
    _enqueue(d, shard_urls["main"], "mdb.plain")
    assert d.caps is not None
    client = redis.Redis.from_url(redis_url)
    client.delete(d.caps.sentinel)
    client.close()
    t0 = time.monotonic()
    report = d.runtime.claim_and_publish()
    elapsed = time.monotonic() - t0
    assert report.claimed == {"intent": 1}
    assert elapsed < 10, f"the down database held the pass for {elapsed:.1f} s"
    assert count_rows(shard_urls["main"], schema, "claim_token IS NULL") == 1  # the capped one


def test_a_busy_pool_is_not_a_down_database(
    make_dispatcher: Callable[..., Dispatcher], shard_urls: dict[str, str]
) -> None:
    """Every connection of the pool in use for longer than new work's 3 s: the next call
    waits for one, as it always did, and the database is not taken for down."""
    d = make_dispatcher(pool_size=1, handler_pool_size=0)  # a pool of one connection
    store = d.database("eu").store
    store.status()  # the pool has its connection
    held = threading.Event()

    def hold() -> None:
        with store.connection():
            held.set()
            time.sleep(4)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    t0 = time.monotonic()
    store.status()
    assert time.monotonic() - t0 > 3
    thread.join()
    assert store.breaker is not None and not store.breaker.down
