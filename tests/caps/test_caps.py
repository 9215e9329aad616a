"""Caps in one process: slots, waiting rows, promotion on release, and the rebuild after Redis
loses its data."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from outbox_dispatch import Context, Dispatcher, Message, Outcome
from outbox_dispatch.caps.semaphore import Caps, Slot
from tests.chaos.services import PrivateRedis, free_port
from tests.conftest import count_rows
from tests.support.capped import (
    _enqueue,
    capped_fixture,  # noqa: F401 (the fixture capped)
    caps_url_fixture,  # noqa: F401 (the fixture caps_url)
    record_fixture,  # noqa: F401 (the fixture record)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_capped_claim_takes_slots_and_sets_the_rest_waiting(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    cmd = record("capped")
    msgs = [Message(cmd, {"i": i}, actor="A") for i in range(10)]
    msgs += [Message(cmd, {"i": i}, actor="B") for i in range(5)]
    msgs += [Message(cmd, {"i": i}) for i in range(3)]  # no actor: uncapped
    _enqueue(capped, database_url, msgs)
    fam = capped.families["capped"]
    result = capped.claimer.claim_family(fam)
    by_actor: dict[str | None, int] = {}
    for c in result.claimed:
        by_actor[c.actor] = by_actor.get(c.actor, 0) + 1
    assert by_actor == {"A": 2, "B": 2, None: 3}
    assert result.waiting == 8 + 3
    assert capped.caps is not None
    assert sorted(capped.caps.holders("capped", "A")) == sorted(
        str(c.token) for c in result.claimed if c.actor == "A"
    )
    # nothing more for A or B until a slot frees: waiting rows are out of the due range
    assert capped.claimer.claim_family(fam).claimed == []
    status = {s.family: s for s in capped.ops.status()}["capped"]
    assert (status.waiting, status.actors_at_cap, status.in_flight) == (11, 2, 7)

    # delivering one of A's rows frees its slot and makes A's oldest waiting row due
    first_a = next(c for c in result.claimed if c.actor == "A")
    assert capped.delivery.deliver(first_a.id, first_a.token).outcome is Outcome.DELIVERED
    assert len(capped.caps.holders("capped", "A")) == 1
    again = capped.claimer.claim_family(fam)
    assert [c.actor for c in again.claimed] == ["A"]
    assert len(capped.caps.holders("capped", "A")) == 2


def test_drain_delivers_every_capped_row(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    cmd = record("capped")
    ids = _enqueue(
        capped, database_url, [Message(cmd, {"i": i}, actor=f"a{i % 3}") for i in range(30)]
    )
    report = capped.drain(timeout=20)
    assert report.delivered == 30
    assert count_rows(database_url, capped.schema, f"id = ANY(ARRAY{ids})") == 0


def test_handler_cap_overrides_the_family_cap(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    one = record("capped", per_actor=1)
    _enqueue(capped, database_url, [Message(one, {}, actor="Z") for _ in range(4)])
    result = capped.claimer.claim_family(capped.families["capped"])
    assert len(result.claimed) == 1 and result.waiting == 3


def test_a_capped_claim_never_exceeds_max_in_flight(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    """The capped claim counts its room in the statement that probes its candidates (no
    round trip of its own): live claims count, settled ones free room, and a full family
    leases nothing and sets nothing waiting."""
    name = f"room{uuid.uuid4().hex[:6]}"
    capped.family(name, per_actor=2, lease=30, max_in_flight=120)
    cmd = record(name)
    _enqueue(capped, database_url, [Message(cmd, {}, actor=f"a{i}") for i in range(300)])
    fam = capped.families[name]
    got = [capped.claimer.claim_family(fam, batch=100) for _ in range(3)]
    assert [len(r.claimed) for r in got] == [100, 20, 0]
    assert [r.waiting for r in got] == [0, 0, 0]
    for c in got[0].claimed[:30]:
        assert capped.delivery.deliver(c.id, c.token).outcome is Outcome.DELIVERED
    assert len(capped.claimer.claim_family(fam, batch=100).claimed) == 30
    assert count_rows(database_url, capped.schema, f"family = '{name}' AND waiting") == 0


def test_a_young_claims_row_starts_without_a_word_to_redis_and_a_dead_holders_slot_goes_back(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    """A capped row whose claim is young surely holds its slot (the claim took it for the
    family's lease moments ago): it starts without writing to or waiting for Redis, and its
    slot runs on to the claim's lease. Should its worker die, the family's next claim after
    the row's lease (the heartbeat timeout from its start) gives the slot back before taking
    slots, so the row runs again then, not a lease later; a slot a heartbeat renewed stays
    (its worker lives, cut off from Postgres only, and its handler still runs). A row whose
    claim is too old asks Redis and waits: renewed to the heartbeat timeout, or, with its slot
    gone, handed back uncounted."""
    assert capped.caps is not None
    caps = capped.caps
    name = f"young{uuid.uuid4().hex[:6]}"
    capped.family(name, per_actor=1, lease=60, heartbeat_timeout=5)
    fam = capped.families[name]
    left: dict[str, float] = {}

    def look(ctx: Context, payload: Any) -> None:
        assert ctx.actor is not None
        [token] = caps.holders(name, ctx.actor)
        left[ctx.actor] = _left_ms(caps, Slot(name, ctx.actor, uuid.UUID(token), 1))

    cmd = record(name, look)
    young, old, dead, cut = _enqueue(
        capped,
        database_url,
        [Message(cmd, {}, actor=a) for a in ("Y", "O", "D", "C")],
    )
    claimed = {c.id: c for c in capped.claimer.claim_family(fam).claimed}
    assert set(claimed) == {young, old, dead, cut}
    _age_claim(capped, database_url, old, 58)
    waited: list[str] = []
    renew = caps.renew

    def counted(family: str, actor: str, *args: Any, **kwargs: Any) -> int:
        waited.append(actor)
        return renew(family, actor, *args, **kwargs)

    caps.renew = counted  # type: ignore[method-assign]
    try:
        first = capped.delivery.deliver(young, claimed[young].token, family_hint=name)
        assert first.outcome is Outcome.DELIVERED and waited == []
        assert left["Y"] > 55_000  # the claim's 60 s, untouched by the start
        second = capped.delivery.deliver(old, claimed[old].token, family_hint=name)
        assert second.outcome is Outcome.DELIVERED and waited == ["O"]
        assert 3000 < left["O"] <= 5000  # renewed to the heartbeat timeout
        # a worker dies in the handler of a young claim's row: started, never settled; and
        # another's heartbeat renews its slot but cannot reach Postgres
        for row_id in (dead, cut):
            started = capped.store.begin(row_id, claimed[row_id].token, fam.heartbeat_timeout)
            assert started is not None and capped.delivery._check_slot(started, fam) is not None
        assert waited == ["O"] and caps.holders(name, "D") == [str(claimed[dead].token)]
        assert renew(name, "C", claimed[cut].token, fam.heartbeat_timeout, heartbeat=True) == 1
        with psycopg.connect(database_url, autocommit=True) as conn:  # their leases run out
            conn.execute(
                f"UPDATE \"{capped.schema}\".outbox SET due_at = now() - interval '1 s' "
                "WHERE id = ANY(%s)",
                ([dead, cut],),
            )
        [again] = capped.claimer.claim_family(fam).claimed  # the dead slot went back first
        assert again.id == dead and again.token != claimed[dead].token
        assert caps.holders(name, "D") == [str(again.token)]
        assert caps.holders(name, "C") == [str(claimed[cut].token)]  # kept: its row waits
        # an old claim whose slot is gone: handed back, uncounted
        [later] = _enqueue(capped, database_url, [Message(cmd, {}, actor="O")])
        [c] = capped.claimer.claim_family(fam).claimed
        _age_claim(capped, database_url, later, 58)
        caps.client.zrem(caps.key(name, "O"), str(c.token))
        third = capped.delivery.deliver(later, c.token, family_hint=name)
        assert third.outcome is Outcome.STALE and third.detail == "cap slot lapsed"
        assert waited == ["O", "O"]
    finally:
        del caps.renew
    assert count_rows(database_url, capped.schema, f"id = {later} AND attempts = 0") == 1


def test_a_claim_gives_back_every_dead_holders_slot_however_many_died(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    """A worker killed with 150 started capped rows (one per actor, cap 1, before their
    first renewal): the claim after their leases gives back all 150 slots and takes the rows
    again, none left waiting a claim's lease behind a dead holder."""
    assert capped.caps is not None
    caps = capped.caps
    name = f"many{uuid.uuid4().hex[:6]}"
    capped.family(name, per_actor=1, lease=60, heartbeat_timeout=5)
    fam = capped.families[name]
    cmd = record(name)
    ids = _enqueue(capped, database_url, [Message(cmd, {}, actor=f"a{i}") for i in range(150)])
    first = {c.id: c for c in capped.claimer.claim_family(fam).claimed}
    assert set(first) == set(ids)
    for c in first.values():  # started, never renewed, never settled
        started = capped.store.begin(c.id, c.token, fam.heartbeat_timeout)
        assert started is not None and capped.delivery._check_slot(started, fam) is not None
    with psycopg.connect(database_url, autocommit=True) as conn:  # their leases run out
        conn.execute(
            f"UPDATE \"{capped.schema}\".outbox SET due_at = now() - interval '1 s' "
            "WHERE id = ANY(%s)",
            (ids,),
        )
    again = {c.id: c for c in capped.claimer.claim_family(fam).claimed}
    assert set(again) == set(ids)  # every row taken again, none set waiting
    for c in again.values():
        actor = f"a{ids.index(c.id)}"
        assert caps.holders(name, actor) == [str(c.token)]


def _age_claim(capped: Dispatcher, database_url: str, row_id: int, seconds: int) -> None:
    """The row's claim as if it were made ``seconds`` ago."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{capped.schema}".outbox SET claimed_at = claimed_at - '
            "make_interval(secs => %s) WHERE id = %s",
            (seconds, row_id),
        )


def test_redis_data_loss_rebuilds_the_semaphores_before_claiming(
    capped: Dispatcher, record: Callable[..., str], database_url: str, caps_url: str
) -> None:
    cmd = record("capped")
    _enqueue(capped, database_url, [Message(cmd, {}, actor="R") for _ in range(6)])
    fam = capped.families["capped"]
    first = capped.claimer.claim_family(fam)
    assert len(first.claimed) == 2
    redis.Redis.from_url(caps_url).flushdb()  # Redis restarts empty
    # the waiting rows come due again (as after one lease): the claim must not hand out
    # fresh slots while the two claimed rows still hold live leases
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{capped.schema}".outbox SET due_at = now() WHERE waiting')
    second = capped.claimer.claim_family(fam)
    assert second.claimed == []
    assert capped.caps is not None
    assert sorted(capped.caps.holders("capped", "R")) == sorted(str(c.token) for c in first.claimed)
    # the loss took the family's waiting flag too (here the refused claim set it again): the
    # rebuild sets it, so that a release still lets the actor's waiting rows in
    redis.Redis.from_url(caps_url).delete(capped.caps.waiting_key("capped"))
    capped.claimer.rebuild_caps()
    capped.caps.take_freed("capped")
    done = first.claimed[0]
    assert capped.delivery.deliver(done.id, done.token).outcome is Outcome.DELIVERED
    assert capped.caps.take_freed("capped").get("R") == 1


def test_redis_down_pauses_capped_rows_but_not_uncapped_ones(
    capped: Dispatcher, record: Callable[..., str], database_url: str, schema: str
) -> None:
    cmd = record("capped")
    _enqueue(capped, database_url, [Message(cmd, {}, actor="D"), Message(cmd, {})])
    broken = Caps("redis://127.0.0.1:1/0", "nowhere")  # nothing listens on port 1
    saved = capped.claimer.caps
    capped.claimer.caps = broken
    try:
        result = capped.claimer.claim_family(capped.families["capped"])
    finally:
        capped.claimer.caps = saved
    assert [c.actor for c in result.claimed] == [None]
    assert (
        count_rows(database_url, schema, "actor = 'D' AND NOT waiting AND claim_token IS NULL") == 1
    )


def test_family_with_one_capped_command_still_delivers_its_uncapped_ones(
    capped: Dispatcher, database_url: str
) -> None:
    app = Celery("mixed", broker="memory://", set_as_current=False)
    d = Dispatcher(
        app,
        database_url=database_url,
        redis_url=capped.settings.redis_url,
        schema=capped.schema,
        key_prefix=capped.caps.prefix if capped.caps else "x",
    )
    d.family("mixed", lease=30)
    ran: list[str] = []
    d.handler("mixed.capped", family="mixed", per_actor=1)(lambda ctx, p: ran.append("capped"))
    d.handler("mixed.free", family="mixed")(lambda ctx, p: ran.append("free"))
    _enqueue(
        d,
        database_url,
        [
            Message("mixed.capped", {}, actor="M"),
            Message("mixed.free", {}, actor="M"),
            Message("mixed.free", {}, actor="M"),
        ],
    )
    report = d.drain(timeout=10)
    assert report.delivered == 3
    assert sorted(ran) == ["capped", "free", "free"]
    d.close()


def test_a_running_handler_whose_slot_lapsed_is_told_to_stop(
    capped: Dispatcher, record: Callable[..., str], database_url: str, caps_url: str
) -> None:
    from outbox_dispatch.worker.heartbeat import Running

    cmd = record("capped")
    _enqueue(capped, database_url, [Message(cmd, {}, actor="H")])
    claimed = capped.claimer.claim_family(capped.families["capped"]).claimed[0]
    started = capped.store.begin(claimed.id, claimed.token, 30)
    assert started is not None
    ctx, running = capped.delivery._context(started, capped.families["capped"])
    assert capped.caps is not None
    redis.Redis.from_url(caps_url).delete(capped.caps.key("capped", "H"))  # the slot expired
    capped.delivery.heartbeats._renew([running])
    assert ctx.is_cancelled
    assert isinstance(running, Running)


def test_a_waiting_rows_old_message_cannot_start_it(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    """A claim whose message was lost keeps its token; when a later claim sets the row
    waiting (its actor at cap), that old message must not start it."""
    cmd = record("capped", per_actor=1)
    _enqueue(capped, database_url, [Message(cmd, {}, actor="W")])
    old = capped.claimer.claim_family(capped.families["capped"]).claimed[0]
    with psycopg.connect(database_url, autocommit=True) as conn:  # what mark_waiting does
        conn.execute(
            f'UPDATE "{capped.schema}".outbox SET waiting = true,'
            " due_at = now() + interval '30 s' WHERE id = %s",
            (old.id,),
        )
    assert capped.delivery.deliver(old.id, old.token).outcome is Outcome.STALE


def test_redis_restarted_from_an_old_snapshot_is_rebuilt(
    capped: Dispatcher, record: Callable[..., str], database_url: str, caps_url: str
) -> None:
    cmd = record("capped")
    _enqueue(capped, database_url, [Message(cmd, {}, actor="G") for _ in range(3)])
    fam = capped.families["capped"]
    first = capped.claimer.claim_family(fam)
    assert len(first.claimed) == 2
    assert capped.caps is not None
    client = redis.Redis.from_url(caps_url)
    client.delete(capped.caps.key("capped", "G"))  # holders newer than the snapshot are gone
    client.set(capped.caps.sentinel, "run-id-of-an-older-redis")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{capped.schema}".outbox SET due_at = now() WHERE waiting')
    assert capped.claimer.claim_family(fam).claimed == []  # rebuilt first: still at cap
    assert len(capped.caps.holders("capped", "G")) == 2


def test_a_real_redis_restarted_from_an_old_snapshot_is_rebuilt_before_the_next_claim(
    database_url: str, schema: str, run_id: str, tmp_path: Path
) -> None:
    """The claimer reads Redis' run id once per connection, not per claim: a server that
    restarts from a snapshot older than its holders is met on a new connection, whose run id
    differs from the sentinel's, and the claim rebuilds before it takes a slot. A real
    redis-server of the test's own, killed -9 and started again from its dump."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server must be installed (the machine's Redis package has it)"
    server = PrivateRedis(binary, tmp_path, free_port())
    server.start()
    d = Dispatcher(
        Celery("snapshot_test", broker=server.url, set_as_current=False),
        database_url=database_url,
        redis_url=server.url,
        schema=schema,
        key_prefix=f"s{run_id}",
    )
    try:
        fam = d.family("snapshotted", per_actor=2, lease=30)
        d.handler("snap.cmd", family="snapshotted")(lambda ctx, payload: None)
        actor = f"S{uuid.uuid4().hex[:6]}"
        _enqueue(d, database_url, [Message("snap.cmd", {}, actor=actor)])
        assert len(d.claimer.claim_family(fam).claimed) == 1
        with server.client() as client:
            client.save()  # the snapshot: the sentinel and the first holder
        _enqueue(d, database_url, [Message("snap.cmd", {}, actor=actor) for _ in range(2)])
        second = d.claimer.claim_family(fam)
        assert (len(second.claimed), second.waiting) == (1, 1)  # at its cap of 2
        server.restart(down=0.1)  # kill -9, then up from the dump: the second holder is gone
        assert d.caps is not None and len(d.caps.holders("snapshotted", actor)) == 1
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                f'UPDATE "{schema}".outbox SET due_at = now() WHERE waiting AND actor = %s',
                (actor,),
            )
        assert d.claimer.claim_family(fam).claimed == []  # rebuilt first: still at its cap
        assert len(d.caps.holders("snapshotted", actor)) == 2
    finally:
        d.close()
        server.close()


def test_a_pass_claims_an_idle_capped_family_only_when_a_slot_of_it_freed(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    """A claim pass over several families claims a capped family with no due row only when
    its actors freed slots (the freed slot makes a waiting row due in that claim); otherwise
    it costs the pass nothing."""
    cmd = record("capped")
    actor = f"idle-{uuid.uuid4().hex[:6]}"
    _enqueue(capped, database_url, [Message(cmd, {"i": i}, actor=actor) for i in range(3)])
    published: list[Any] = []
    claims: list[str] = []
    store = capped.store
    real = store.claim_capped

    def counted(family: Any, *args: Any, **kwargs: Any) -> Any:
        claims.append(family.name)
        return real(family, *args, **kwargs)

    store.claim_capped = counted  # type: ignore[method-assign]
    try:
        first = capped.claimer.run(lambda f, rows, size: published.extend(rows))
        assert first.claimed.get("capped") == 2 and first.waiting.get("capped") == 1
        claims.clear()
        idle = capped.claimer.run(lambda f, rows, size: published.extend(rows))
        assert idle.total == 0 and claims == []  # waiting row, no freed slot: not claimed
        row = next(c for c in published if c.actor == actor)
        assert capped.delivery.deliver(row.id, row.token).outcome is Outcome.DELIVERED
        freed = capped.claimer.run(lambda f, rows, size: published.extend(rows))
    finally:
        del store.claim_capped
    assert claims == ["capped"]
    assert freed.claimed == {"capped": 1}  # the waiting row, let in by the freed slot
    assert [c.actor for c in published[-1:]] == [actor]


def test_pipelined_scripts_work_as_a_fresh_process_s_first_call_and_after_a_script_flush(
    caps_url: str, run_id: str
) -> None:
    """A claim's acquire and a delivered row's release are pipelined EVALSHAs (no SCRIPT
    EXISTS round trip): they work as the first call of a fresh process, which has not
    registered its scripts yet (a pool process's first capped batch failed so), and when
    Redis lost its scripts (restarted, flushed), which loads them and runs the calls again,
    each once."""
    prefix = f"t{run_id}fresh"
    owner = Caps(caps_url, prefix)
    owner.restore([])  # the semaphores are complete (nothing held)
    a, b = Slot("f", "a", uuid.uuid4(), 1), Slot("f", "b", uuid.uuid4(), 1)
    fresh = Caps(caps_url, prefix)  # a new process's: nothing registered, nothing connected
    assert fresh.acquire_many([a, b], lease=30, waiting=True) == [True, True]
    woken = fresh.release_settled([a], wait=False)
    woken |= fresh.release_settled([], wait=True)  # every answer read
    assert woken == {("f", None)} and fresh.holders("f", "a") == []
    redis.Redis.from_url(caps_url).script_flush()
    fresh.release_settled([b], wait=False)
    fresh.release_settled([], wait=True)
    assert fresh.holders("f", "b") == []  # ran again after NOSCRIPT
    redis.Redis.from_url(caps_url).script_flush()
    c = Slot("f", "c", uuid.uuid4(), 1)
    assert fresh.acquire_many([c], lease=30) == [True]
    fresh.release_settled([c])
    assert fresh.holders("f", "c") == []
    fresh.close()
    owner.close()


def _left_ms(caps: Caps, slot: Slot) -> float:
    """Milliseconds the slot has left, in Redis time (it must hold one)."""
    r = caps.client
    score = r.zscore(caps.key(slot.family, slot.actor, slot.scope), str(slot.token))
    assert score is not None, f"{slot} holds nothing"
    seconds, micros = r.time()
    return float(score) - (seconds * 1000 + micros / 1000)


def test_releases_sent_without_waiting_free_their_slots_and_lose_no_wake(
    caps_url: str, run_id: str
) -> None:
    """A release on the delivery path is written without waiting for Redis's answer
    (caps/releases.py): the slot is free once Redis has read it, and the answer that says
    "wake the claimer" is not lost, only read later, with the next release that waits."""
    caps = Caps(caps_url, f"t{run_id}async")
    caps.restore([])
    slots = [Slot("f", f"a{i}", uuid.uuid4(), 1) for i in range(3)]
    assert caps.acquire_many(slots, lease=30, waiting=True) == [True] * 3
    woken = caps.release_settled(slots[:2], wait=False)  # what arrived by now, maybe nothing
    woken |= caps.release_settled([slots[2]], wait=True)  # reads every answer
    assert woken == {("f", None)}  # the first release of the window asked for a claim
    assert all(caps.holders("f", s.actor) == [] for s in slots)
    again = Slot("f", "a0", uuid.uuid4(), 1)  # the freed slot can be taken again
    assert caps.acquire_many([again], lease=30) == [True]
    assert caps.release_settled([], wait=True) == set()  # nothing unread: no round trip
    # a process delivering for two databases sends both's releases: each wake names its own
    d2, d3 = Slot("f", "d", uuid.uuid4(), 1), Slot("f", "e", uuid.uuid4(), 1)
    assert caps.acquire_many([d2, d3], lease=30, waiting=True) == [True, True]
    time.sleep(caps.wake_ms / 1000 + 0.05)  # past the first database's wake window
    # an unwaited release returns the answers that arrived by then: they count too
    woken = caps.release_settled([d2], "db2", wait=False)
    woken |= caps.release_settled([d3], wait=False)
    woken |= caps.release_settled([], wait=True)
    assert woken == {("f", "db2"), ("f", None)}
    caps.close()


def test_a_release_notes_its_slot_and_wakes_the_claimer_only_while_rows_wait(
    caps_url: str, run_id: str
) -> None:
    """With no row waiting for a slot, a release frees its slot and that is all: no freed
    note, no wake, so a capped family at low load costs its claimer no extra claim. A slot
    refused (or a claim that sets rows waiting) sets the family's waiting flag, for two
    leases, in the same script run, so the holder's release right after notes its slot for
    the actor's waiting row and wakes the claimer."""
    caps = Caps(caps_url, f"t{run_id}flag")
    caps.restore([])
    a = Slot("f", "a", uuid.uuid4(), 1)
    assert caps.acquire_many([a], lease=30) == [True]
    assert caps.release_settled([a], wait=True) == set()
    assert caps.holders("f", "a") == [] and caps.take_freed("f") == {}
    held, refused = Slot("f", "a", uuid.uuid4(), 1), Slot("f", "a", uuid.uuid4(), 1)
    assert caps.acquire_many([held, refused], lease=30) == [True, False]
    assert 0 < redis.Redis.from_url(caps_url).pttl(caps.waiting_key("f")) <= 60_000
    assert caps.release_settled([held], wait=True) == {("f", None)}
    assert caps.take_freed("f") == {"a": 1}
    caps.close()


def test_a_release_sent_before_redis_lost_its_scripts_runs_again_once(
    caps_url: str, run_id: str
) -> None:
    """Releases written while Redis has lost its scripts (SCRIPT FLUSH, a failover) answer
    NOSCRIPT: each runs again the slow way, which loads the script, and frees its slot."""
    caps = Caps(caps_url, f"t{run_id}flush")
    caps.restore([])
    first, second = Slot("f", "a", uuid.uuid4(), 2), Slot("f", "a", uuid.uuid4(), 2)
    assert caps.acquire_many([first, second], lease=30, waiting=True) == [True, True]
    assert caps.release_settled([first], wait=True) == {("f", None)}  # the connection is open now
    redis.Redis.from_url(caps_url).script_flush()
    caps.release_settled([second], wait=True)
    assert caps.holders("f", "a") == []
    freed = redis.Redis.from_url(caps_url).hget(caps.freed_key("f"), "a")
    assert freed == b"2"  # each release counted once, for the claimer to let two rows in
    caps.close()


def test_a_release_that_cannot_reach_redis_is_logged_and_the_slot_expires(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis unreachable: the release says so in the log and returns; the slot runs out with
    its lease (the cap stays safe), and the delivery goes on."""
    caps = Caps("redis://127.0.0.1:1/0", "tdown")
    with caplog.at_level("WARNING", logger="outbox_dispatch.caps.releases"):
        assert caps.release_settled([Slot("f", "a", uuid.uuid4(), 1)], wait=False) == set()
    assert "slots free when their leases end" in caplog.text
    caps.close()


def test_a_freed_slots_waiting_row_the_claim_has_no_room_for_comes_due_at_once(
    capped: Dispatcher, record: Callable[..., str], database_url: str, schema: str
) -> None:
    """Waiting rows whose actor freed a slot are offered first and leased straight from
    waiting; one the claim has no room for (its batch is full) comes due now instead of
    after its waiting lease, so the next claim takes it without another freed slot."""
    name = f"room{uuid.uuid4().hex[:6]}"
    capped.family(name, per_actor=1, lease=30)
    cmd = record(name)
    a1, a2, b1, b2 = _enqueue(
        capped, database_url, [Message(cmd, {}, actor=x) for x in ("A", "A", "B", "B")]
    )
    fam = capped.families[name]
    first = capped.claimer.claim_family(fam)
    assert sorted(c.id for c in first.claimed) == [a1, b1] and first.waiting == 2
    for c in first.claimed:
        assert capped.delivery.deliver(c.id, c.token).outcome is Outcome.DELIVERED
    one = capped.claimer.claim_family(fam, batch=1)  # both actors freed a slot; room for one
    assert [c.id for c in one.claimed] == [a2] and one.waiting == 0
    assert count_rows(database_url, schema, f"id = {b2} AND NOT waiting AND due_at <= now()")
    rest = capped.claimer.claim_family(fam)  # no slot freed since
    assert [c.id for c in rest.claimed] == [b2]


def _leased(database_url: str, schema: str, row_id: int, timeout: float) -> uuid.UUID | None:
    """The row's claim token once a claim leased it, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                f"SELECT claim_token FROM {schema}.outbox WHERE id = %s AND NOT waiting",
                (row_id,),
            ).fetchone()
            if row and row[0] is not None:
                return uuid.UUID(str(row[0]))
            time.sleep(0.01)
    return None


def test_a_slot_freed_inside_the_wake_window_after_a_claim_still_lets_its_actor_in(
    capped: Dispatcher, record: Callable[..., str], database_url: str, schema: str
) -> None:
    """A release wakes the claimer once per wake window. Here the second release comes
    inside the window that the first one's wake opened, after the claim it woke took the
    first freed slot: it announces nothing, and it is the backlog's last. The listener's
    trailing claim, one window later, lets the actor's last row in; before it, that row
    waited with its slot free until the next sweep (none here)."""
    name = f"trail{uuid.uuid4().hex[:6]}"
    capped.family(name, per_actor=1, lease=30)
    cmd = record(name)
    r1, r2, r3 = _enqueue(
        capped, database_url, [Message(cmd, {"i": i}, actor="A") for i in range(3)]
    )
    assert capped.caps is not None
    window = capped.caps.wake_ms
    capped.caps.wake_ms = 1000  # wide enough that the second release surely falls inside it
    listener = capped.runtime.commit_listener()
    listener.sweep = None
    listener.start()
    try:
        assert listener.leading.wait(5)
        for row in (r1, r2):
            token = _leased(database_url, schema, row, 5)
            assert token is not None
            assert capped.delivery.deliver(row, token).outcome is Outcome.DELIVERED
        freed = time.monotonic()
        assert _leased(database_url, schema, r3, 5) is not None, "r3 never let in"
        assert time.monotonic() - freed < 2.5  # one wake window and the claim, not a sweep
    finally:
        listener.stop()
        capped.caps.wake_ms = window


def test_a_claims_slots_are_taken_in_order_in_script_runs_of_a_hundred(
    caps_url: str, run_id: str
) -> None:
    """A claim's slots go in one round trip, a script run per hundred: an actor's slots are
    judged in order across the runs' boundary (its cap counts what earlier runs granted), and
    a token that already holds its slot is renewed, not counted twice."""
    caps = Caps(caps_url, f"t{run_id}many")
    caps.restore([])
    slots = [Slot("f", f"a{i}", uuid.uuid4(), 1) for i in range(98)]
    slots += [Slot("f", "x", uuid.uuid4(), 3) for _ in range(5)]  # slots 98-102
    slots += [Slot("f", f"b{i}", uuid.uuid4(), 1) for i in range(150)]
    slots.append(slots[0])  # the first row's slot again: renewed
    granted = caps.acquire_many(slots, lease=30)
    assert len(granted) == len(slots)
    assert granted[98:103] == [True, True, True, False, False]
    assert all(granted[:98]) and all(granted[103:])
    assert len(caps.holders("f", "x")) == 3 and len(caps.holders("f", "a0")) == 1
    assert caps.acquire_many([Slot("f", "a0", uuid.uuid4(), 1)], lease=30) == [False]
    caps.close()
