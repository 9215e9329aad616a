"""A claim commits, then its publish fails (the broker is down): its rows must be claimable
again at once, not after their lease, with no attempt counted and no cap slot kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from outbox_dispatch import Dispatcher, Message

pytestmark = pytest.mark.usefixtures("clean")


def _app(name: str, broker: str) -> Celery:
    app = Celery(name, broker=broker, set_as_current=False)
    # a broker that refuses: the publish fails after kombu's few quick retries
    app.conf.update(broker_connection_retry=False, broker_connection_max_retries=0)
    return app


def _dispatcher(
    app: Celery, database_url: str, redis_url: str, schema: str, keys: str
) -> Dispatcher:
    d = Dispatcher(
        app,
        database_url=database_url,
        redis_url=redis_url,
        schema=schema,
        key_prefix=keys,
        listen=False,
    )
    d.family("pubfail", lease=60)
    d.family("pubfailcap", lease=60, per_actor=1)
    for family in ("pubfail", "pubfailcap"):
        d.handler(f"pf.{family}", family=family)(lambda ctx, payload: None)
    return d


@pytest.fixture
def dispatchers(
    database_url: str, redis_url: str, schema: str, key_prefix: str
) -> Iterator[tuple[Dispatcher, Dispatcher]]:
    """One whose broker is down (nothing listens on port 1), one whose broker works (kombu's
    in-memory transport: what it publishes, nobody consumes); the same caps keys."""
    keys = f"{key_prefix}pubfail"
    down = _dispatcher(
        _app("pf_down", "redis://127.0.0.1:1/0"), database_url, redis_url, schema, keys
    )
    up = _dispatcher(_app("pf_up", "memory://"), database_url, redis_url, schema, keys)
    yield down, up
    down.close()
    up.close()


def _rows(database_url: str, schema: str, family: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        return cur.execute(
            f"SELECT id, attempts, claim_token, started_at, due_at <= now() AS due "
            f'FROM "{schema}".outbox WHERE family = %s ORDER BY id',
            (family,),
        ).fetchall()


def test_a_claim_whose_publish_fails_gives_its_rows_back_at_once(
    dispatchers: tuple[Dispatcher, Dispatcher], database_url: str, schema: str
) -> None:
    """Before, the rows waited out their 60 s lease while the process lived on, and the
    capped ones' slots kept their actors at their cap (here cap 1) as long."""
    down, up = dispatchers
    with psycopg.connect(database_url) as conn, conn.transaction():
        down.enqueue_many(conn, [Message("pf.pubfail", {"n": i}) for i in range(3)])
        down.enqueue_many(
            conn, [Message("pf.pubfailcap", {"n": i}, actor=a) for i, a in enumerate("ab")]
        )
    for family in ("pubfail", "pubfailcap"):
        with pytest.raises(Exception, match="onnect"):  # kombu's or redis-py's error
            down.runtime.claim_and_publish([family])
        rows = _rows(database_url, schema, family)
        # claimed (the claim counted its attempt), and due again now, not in 60 s
        assert [(r["attempts"], r["started_at"], r["due"]) for r in rows] == [
            (1, None, True)
        ] * len(rows)
        assert all(r["claim_token"] is not None for r in rows)
    # the next claim takes them at once, counting no second attempt, and the capped rows'
    # actors are not held at their cap by the slots of the claim that failed
    assert up.runtime.claim_and_publish(["pubfail"]).claimed == {"pubfail": 3}
    assert up.runtime.claim_and_publish(["pubfailcap"]).claimed == {"pubfailcap": 2}
    for family in ("pubfail", "pubfailcap"):
        assert [r["attempts"] for r in _rows(database_url, schema, family)] == [1] * (
            3 if family == "pubfail" else 2
        )
