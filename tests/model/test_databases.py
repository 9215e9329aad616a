"""A model-based test (hypothesis stateful) of one Dispatcher over three real databases, with
a capped family (one row per actor at a time) and an ordered one. Its rules enqueue into any
database, claim one database, finish or lose a claimed row, and flush Redis (the next capped
claim rebuilds the semaphores from every database). After every step: each row is in the
database it was written to; no actor has more than its cap of live leases over all the
databases, nor more live holders in Redis; no ordered line has two rows in flight. At the end
every row is delivered, exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from outbox_dispatch import Context, Dispatcher
from outbox_dispatch.core.rows import Claimed
from outbox_dispatch.core.settle import Outcome

pytestmark = pytest.mark.usefixtures("clean")

NAMES = ("main", "eu", "us")
ACTORS = ("A", "B")
CAPPED, LINE = "capped", "line"


@pytest.mark.timeout(300)
def test_model_over_databases(
    make_dispatcher: Callable[..., Dispatcher],
    shard_urls: dict[str, str],
    schema: str,
    redis_url: str,
) -> None:
    d = make_dispatcher()
    d.family(CAPPED, per_actor=1, lease=60)
    d.family(LINE, ordered=True, lease=60)
    ran: list[tuple[str, int]] = []
    for family in (CAPPED, LINE):

        @d.handler(f"model.{family}", family=family)
        def record(ctx: Context, payload: Any) -> None:
            ran.append((ctx.database, ctx.row_id))

    client = redis.Redis.from_url(redis_url)
    assert d.caps is not None
    caps_prefix = d.caps.prefix

    # one autocommit connection per database for the checks, opened once: they run after
    # every step of every example
    readers = {name: psycopg.connect(url, autocommit=True) for name, url in shard_urls.items()}

    def live_leases(db: str, family: str) -> dict[str, int]:
        rows = (
            readers[db]
            .execute(
                f'SELECT actor, count(*) FROM "{schema}".outbox WHERE family = %s AND'
                " claim_token IS NOT NULL AND due_at > now() GROUP BY actor",
                (family,),
            )
            .fetchall()
        )
        return {str(a): int(n) for a, n in rows}

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            for reader in readers.values():
                reader.execute(f'TRUNCATE "{schema}".outbox')
            for key in client.scan_iter(f"{caps_prefix}:*"):
                client.delete(key)
            ran.clear()
            self.written: dict[tuple[str, int], str] = {}  # (database, id) -> family
            self.claimed: list[tuple[str, str, Claimed]] = []  # database, family, row
            self.lost: list[tuple[str, str, Claimed]] = []

        @rule(db=st.sampled_from(NAMES), actor=st.sampled_from(ACTORS), capped=st.booleans())
        def enqueue(self, db: str, actor: str, capped: bool) -> None:
            family = CAPPED if capped else LINE
            with psycopg.connect(shard_urls[db]) as conn, conn.transaction():
                row_id = d.enqueue(conn, f"model.{family}", {"x": 1}, actor=actor)
            self.written[(db, row_id)] = family

        @rule(db=st.sampled_from(NAMES), capped=st.booleans())
        def claim(self, db: str, capped: bool) -> None:
            family = d.families[CAPPED if capped else LINE]
            result = d.database(db).claimer.claim_family(family)
            self.claimed += [(db, family.name, c) for c in result.claimed]

        @precondition(lambda self: bool(self.claimed))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            db, family, c = self.claimed.pop(data.draw(st.integers(0, len(self.claimed) - 1)))
            result = d.database(db).delivery.deliver(c.id, c.token, family_hint=family)
            assert result.outcome is Outcome.DELIVERED

        @precondition(lambda self: bool(self.claimed))
        @rule(data=st.data())
        def lose_message(self, data: st.DataObject) -> None:
            """The broker lost it: the row waits out its lease (moved past below)."""
            db, family, c = self.claimed.pop(data.draw(st.integers(0, len(self.claimed) - 1)))
            self.lost.append((db, family, c))  # its lease runs out in teardown

        @rule()
        def lose_redis(self) -> None:
            for key in client.scan_iter(f"{caps_prefix}:ca*"):
                client.delete(key)

        @invariant()
        def rows_stay_in_their_database(self) -> None:
            done = set(ran)
            for db, reader in readers.items():
                rows = reader.execute(f'SELECT id, family FROM "{schema}".outbox').fetchall()
                found: dict[int, str] = {int(i): str(f) for i, f in rows}
                for (where, row_id), family in self.written.items():
                    if where == db and (db, row_id) not in done:
                        assert found.get(row_id) == family, (db, row_id)

        @invariant()
        def one_live_lease_per_actor_over_all_databases(self) -> None:
            for family in (CAPPED, LINE):
                per_db = [live_leases(db, family) for db in readers]
                for actor in ACTORS:
                    if family == CAPPED:
                        total = sum(counts.get(actor, 0) for counts in per_db)
                        assert total <= 1, (family, actor, per_db)
                    else:  # ordered: one line per database and actor
                        assert all(counts.get(actor, 0) <= 1 for counts in per_db), per_db
            for actor in ACTORS:
                assert len(d.caps.holders(CAPPED, actor)) <= 1  # type: ignore[union-attr]

        def teardown(self) -> None:
            for db, family, c in self.claimed:  # finish what is in flight, then drain the rest
                d.database(db).delivery.deliver(c.id, c.token, family_hint=family)
            for database in d.databases.values():
                database.store.clock_offset = 120.0  # past every lease: lost ones come back
            # and their slots with them: as if Redis had kept them until their leases ran out,
            # which the rebuild (reading Postgres at the moved clock) now sees
            self.lose_redis()
            try:
                d.drain(timeout=60)
            finally:
                for database in d.databases.values():
                    database.store.clock_offset = 0.0
            assert sorted(ran) == sorted(self.written), "each row delivered exactly once"

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
    client.close()
    for reader in readers.values():
        reader.close()
