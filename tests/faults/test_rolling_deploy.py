"""Rolling deploys cost no lease: a worker stopped warm hands back the rows it holds but has not
started (and their cap slots) at once, and rows still running when its shutdown ends (Celery's
soft shutdown timeout, then the cold shutdown) are marked lost at once, not left for their
heartbeat timeout. A worker that joins when Postgres refuses it sessions sends the messages it
takes back to the queue at once. The leases here are long (120 s), so a row left to its lease
would show."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from subprocess import Popen
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from psycopg.conninfo import make_conninfo

from outbox_dispatch import Dispatcher, Message
from outbox_dispatch.store.migrations import migrate
from outbox_dispatch.worker.leaving import Leaving, hand_back, message_rows
from tests.apps.caps_families import declare_families
from tests.faults.test_lifecycle_processes import _enqueue, _query, _wait

LEASE = "120"  # the queue lease and the heartbeat timeout of every family here
# How soon after the signal another worker must start a row the leaving one held: the issue's
# bound, far below the lease and the heartbeat timeout a stranded row would wait.
HANDED_BACK_WITHIN = 2.0

POOLS = ["threads", "prefork"]


@pytest.fixture
def env(acc_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    schema = f"od_roll_{run_id}_{random.randrange(10**6)}"
    e = {
        **acc_env,
        "OUTBOX_TEST_SCHEMA": schema,
        "OUTBOX_TEST_KEY_PREFIX": f"{schema}:",
        "OUTBOX_TEST_LEASE": LEASE,
    }
    migrate(e["OUTBOX_TEST_DATABASE_URL"], schema)
    with psycopg.connect(e["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".runs (row_id bigint, kind text, attempt int,'
            " maybe_applied bool, pid int, tick text, at timestamptz DEFAULT clock_timestamp())"
        )
        conn.execute(f'CREATE TABLE "{schema}".effects (row_id bigint)')
    yield e
    with psycopg.connect(e["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _worker(
    spawn: Callable[..., Popen[bytes]],
    env: dict[str, str],
    name: str,
    *,
    app: str = "tests.apps.lifecycle_app",
    pool: str,
    c: int,
    prefetch: int = 1,
    config: tuple[str, ...] = (),
    queues: str | None = None,
) -> Popen[bytes]:
    args = [
        *(sys.executable, "-m", "celery", "-A", app, "worker"),
        *("-P", pool, "-c", str(c), "-n", f"{name}@%h", "--loglevel", "INFO"),
        *("--prefetch-multiplier", str(prefetch)),
        *(("-Q", queues) if queues else ()),
    ]
    return spawn([*args, "--", *config] if config else args, env, name)


def _now(env: dict[str, str]) -> datetime:
    return _query(env, "SELECT clock_timestamp()")[0][0]  # type: ignore[no-any-return]


def _starts(env: dict[str, str]) -> dict[int, list[tuple[int, bool, int, datetime]]]:
    """Each row's attempts as its handler recorded them: (attempt, maybe_applied, pid, at)."""
    out: dict[int, list[tuple[int, bool, int, datetime]]] = {}
    rows = _query(
        env, "SELECT row_id, attempt, maybe_applied, pid, at FROM S.runs WHERE kind = 'start'"
    )
    for row_id, attempt, maybe, pid, at in sorted(rows, key=lambda r: r[4]):
        out.setdefault(row_id, []).append((attempt, maybe, pid, at))
    return out


CLAIMED = "SELECT 1 FROM S.outbox WHERE id = %s AND claim_token IS NOT NULL"


def _enqueue_one_at_a_time(env: dict[str, str], msgs: list[Message]) -> list[int]:
    """Each row claimed before the next is enqueued: one row per message."""
    ids = []
    for msg in msgs:
        [row_id] = _enqueue(env, [msg])
        _wait(lambda row_id=row_id: bool(_query(env, CLAIMED, row_id)), 20, "a claim")  # type: ignore[misc]
        ids.append(row_id)
    return ids


@pytest.mark.parametrize("pool", POOLS)
def test_sigterm_hands_claimed_unstarted_rows_to_another_worker_at_once(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]], pool: str, tmp_path: Path
) -> None:
    """The leaving worker runs one row and holds three more it reserved (prefetched) but did
    not start, with room for more (so it must stop taking messages before the three are
    claimed again); the staying worker has room. After SIGTERM the three start on the staying
    worker within seconds, first attempts, while the leaving worker's own row runs to its end
    (warm shutdown) there."""
    leaving = _worker(spawn, env, "leaving", pool=pool, c=1, prefetch=8)
    [first] = _enqueue(env, [Message("slow.run", {"sleep": 8})])
    _wait(lambda: first in _starts(env), 30, "the leaving worker's first row")
    leaving_pid = _starts(env)[first][0][2]
    held = _enqueue_one_at_a_time(env, [Message("slow.run", {"sleep": 8}) for _ in range(3)])
    _worker(spawn, env, "staying", pool=pool, c=6)
    log = tmp_path / "staying.log"
    _wait(lambda: "ready." in log.read_text(errors="replace"), 60, "the staying worker")
    assert not set(held) & set(_starts(env)), "the leaving worker held no unstarted row"

    sent_at = _now(env)
    leaving.send_signal(signal.SIGTERM)
    _wait(lambda: set(held) <= set(_starts(env)), 60, "the held rows")
    starts = _starts(env)
    after = {r: (starts[r][0][3] - sent_at).total_seconds() for r in held}
    print(f"{pool}: held rows started {sorted(after.values())} s after SIGTERM (lease {LEASE} s)")
    for r in held:
        attempt, maybe, pid, _at = starts[r][0]
        assert (attempt, maybe) == (1, False)  # handed back uncounted
        assert pid != leaving_pid
    assert max(after.values()) < HANDED_BACK_WITHIN, after
    assert leaving.wait(30) == 0
    # the leaving worker's own row ran to its end there, once
    assert [s[:3] for s in starts[first]] == [(1, False, leaving_pid)]
    _wait(lambda: _live(env) == 0, 30, "every row settled")
    ends = _query(env, "SELECT row_id FROM S.runs WHERE kind = 'end'")
    assert sorted(r for (r,) in ends) == sorted([first, *held])


def test_a_worker_postgres_refuses_sends_the_messages_it_takes_back_to_the_queue(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]], tmp_path: Path
) -> None:
    """A worker that joins when Postgres refuses it sessions (max_connections reached, or, as
    here, its role's connection limit) still takes delivery messages. Each goes back to the
    queue once a start has waited CONNECTION_WAIT for a connection, not held for the pool's
    30 s nor its rows left to their lease; a worker with a session then runs them at once,
    first attempts. Until then no row starts anywhere. (Prefork: a message goes back from the
    pool process that took it, by the task's own code, as from a threads pool's thread.)"""
    role = f"od_refused_{uuid.uuid4().hex[:8]}"
    url = env["OUTBOX_TEST_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 0')
    try:
        refused_env = {**env, "OUTBOX_TEST_DATABASE_URL": make_conninfo(url, user=role)}
        # the claimer claims at commit (its listener) and delivers nothing
        _worker(spawn, env, "claimer", pool="threads", c=1, queues="outbox.claim")
        _worker(spawn, refused_env, "refused", pool="prefork", c=2, queues="outbox.slow")
        log = tmp_path / "refused.log"
        _wait(lambda: "ready." in log.read_text(errors="replace"), 60, "the refused worker")
        ids = _enqueue_one_at_a_time(env, [Message("slow.run", {"sleep": 0.1}) for _ in range(3)])
        _wait(lambda: log.read_text(errors="replace").count("requeued") >= 3, 60, "requeues")
        assert _starts(env) == {}
        assert all(_query(env, CLAIMED, i) for i in ids)  # still claimed: not handed back

        _worker(spawn, env, "staying", pool="threads", c=4, queues="outbox.slow")
        _wait(
            lambda: set(ids) <= set(_starts(env)), 60, "the rows started by a worker with a session"
        )
        starts = _starts(env)
        assert {r: [s[:2] for s in starts[r]] for r in ids} == {r: [(1, False)] for r in ids}
        text = log.read_text(errors="replace")
        assert "ERROR" not in text and "too many connections for role" in text
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _live(env: dict[str, str]) -> int:
    return int(_query(env, "SELECT count(*) FROM S.outbox WHERE parked_at IS NULL")[0][0])


# -- capped --------------------------------------------------------------------------------

CAPS_DB = 13


@pytest.fixture
def caps_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    url = env["OUTBOX_TEST_REDIS_URL"].rsplit("/", 1)[0] + f"/{CAPS_DB}"
    e = {**env, "OUTBOX_TEST_REDIS_URL": url}
    with psycopg.connect(e["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{e["OUTBOX_TEST_SCHEMA"]}".runs')
        conn.execute(
            f'CREATE TABLE "{e["OUTBOX_TEST_SCHEMA"]}".runs (row_id bigint, family text,'
            " actor text, n int, attempt int, started float8, ended float8, ok bool,"
            " maybe_applied bool, pid int)"
        )
    yield e
    redis.Redis.from_url(url).flushdb()


def _caps_enqueue(env: dict[str, str], msgs: list[Message]) -> list[int]:
    app = Celery("producer", broker=env["OUTBOX_TEST_REDIS_URL"], set_as_current=False)
    d = Dispatcher(
        app,
        database_url=env["OUTBOX_TEST_DATABASE_URL"],
        redis_url=env["OUTBOX_TEST_REDIS_URL"],
        schema=env["OUTBOX_TEST_SCHEMA"],
    )
    declare_families(d, float(LEASE))
    d.declare("work.capped", family="capped")
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn, conn.transaction():
        ids = d.enqueue_many(conn, msgs)
    d.close()
    return ids


def _caps_runs(env: dict[str, str]) -> list[dict[str, Any]]:
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        return cur.execute(
            f'SELECT * FROM "{env["OUTBOX_TEST_SCHEMA"]}".runs ORDER BY started'
        ).fetchall()


def test_sigterm_gives_back_the_cap_slots_of_rows_it_had_not_started(
    caps_env: dict[str, str], spawn: Callable[..., Popen[bytes]]
) -> None:
    """Actor x may run two rows at once. The leaving worker runs one and holds the other (its
    slot taken at the claim), a third waits for a slot. After SIGTERM the held row's slot goes
    back with it: the staying worker runs x's rows within seconds, while the leaving worker's
    own row still runs, and x never has more than two running. (Prefork: the hand back runs
    in the worker's main process, whichever its pool; the SIGTERM test above runs both.)"""
    pool = "prefork"
    env = caps_env
    app = "tests.apps.caps_app"
    leaving = _worker(spawn, env, "leaving", app=app, pool=pool, c=1, prefetch=2)

    def started(row_id: int) -> bool:
        return any(r["row_id"] == row_id for r in _caps_runs(env))

    def claimed(row_id: int) -> bool:
        return bool(_query(env, CLAIMED, row_id))

    work = Message("work.capped", {"sleep": 8, "mark_start": True}, actor="x")
    [running] = _caps_enqueue(env, [work])
    _wait(lambda: started(running), 30, "the leaving worker's first row")
    leaving_pid = _caps_runs(env)[0]["pid"]
    [held] = _caps_enqueue(env, [work])
    _wait(lambda: claimed(held), 20, "the second row's claim")
    [waiting] = _caps_enqueue(env, [work])  # actor x is at its cap: this one waits
    # another actor's row: the leaving worker holds two messages (its prefetch), so the
    # staying worker takes it, and is up once it ran it
    _worker(spawn, env, "staying", app=app, pool=pool, c=4)
    [other] = _caps_enqueue(env, [Message("work.capped", {"sleep": 0.01}, actor="y")])
    _wait(lambda: started(other), 60, "the staying worker's row")
    assert not started(held) and not started(waiting)

    sent_at = time.time()
    leaving.send_signal(signal.SIGTERM)
    _wait(lambda: started(held) and started(waiting), 60, "actor x's other rows")
    runs = {r["row_id"]: r for r in _caps_runs(env) if not r["ok"]}  # the starts
    first_after = min(runs[held]["started"], runs[waiting]["started"]) - sent_at
    print(f"{pool}: a held-back slot's row started {first_after:.2f} s after SIGTERM")
    assert first_after < HANDED_BACK_WITHIN
    assert {runs[held]["pid"], runs[waiting]["pid"]}.isdisjoint({leaving_pid})
    assert leaving.wait(30) == 0
    # x never ran more than two at once (each start against the others' spans)

    def spans() -> list[tuple[float, float]]:
        return [
            (r["started"], r["ended"]) for r in _caps_runs(env) if r["ok"] and r["actor"] == "x"
        ]

    _wait(lambda: len(spans()) == 3, 30, "actor x's rows to end")
    assert runs[running]["pid"] == leaving_pid
    for s, _e in spans():
        assert sum(1 for s2, e2 in spans() if s2 <= s < e2) <= 2, spans()


# -- rows still running when the shutdown ends ---------------------------------------------


SOFT_SHUTDOWN = 2  # seconds: worker_soft_shutdown_timeout of the leaving worker


@pytest.mark.parametrize("remap", [False, True], ids=["sigquit", "sigterm_remapped"])
def test_rows_running_when_the_soft_shutdown_ends_run_again_at_once_flagged(
    env: dict[str, str], spawn: Callable[..., Popen[bytes]], remap: bool
) -> None:
    """Celery's soft shutdown (``worker_soft_shutdown_timeout``, then the cold shutdown that
    cancels the tasks still running), started by SIGQUIT, or by SIGTERM with
    ``REMAP_SIGTERM=SIGQUIT``: the row whose handler was cut off runs again on the staying
    worker right after, with maybe_applied, not after its 120 s heartbeat timeout. Prefork only:
    Celery's threads pool cannot cancel a running task (its cold shutdown fails)."""
    leaving_env = {**env, "REMAP_SIGTERM": "SIGQUIT"} if remap else env
    config = (f"worker_soft_shutdown_timeout={SOFT_SHUTDOWN}",)
    leaving = _worker(spawn, leaving_env, "leaving", pool="prefork", c=1, config=config)
    [row] = _enqueue(env, [Message("slow.run", {"sleep": 60})])
    _wait(lambda: row in _starts(env), 30, "the first attempt")
    _worker(spawn, env, "staying", pool="prefork", c=2)
    [other] = _enqueue(env, [Message("slow.run", {"sleep": 0.01})])
    _wait(lambda: other in _starts(env), 60, "a row on the staying worker")
    sent_at = _now(env)
    leaving.send_signal(signal.SIGTERM if remap else signal.SIGQUIT)
    leaving.wait(30)
    assert not _alive(_starts(env)[row][0][2]), "the cut-off handler's process still runs"
    _wait(lambda: len(_starts(env)[row]) == 2, 60, "the second attempt")
    (a1, m1, pid1, _), (a2, m2, pid2, at2) = _starts(env)[row]
    gone = (at2 - sent_at).total_seconds()
    print(
        f"the cut-off row ran again {gone:.2f} s after the signal (soft timeout {SOFT_SHUTDOWN} s)"
    )
    assert (a1, m1, a2, m2) == (1, False, 2, True)
    assert pid2 != pid1
    # the soft shutdown's wait, Celery's cold shutdown, then at once: far from the 120 s
    assert gone < SOFT_SHUTDOWN + 3 * HANDED_BACK_WITHIN, gone
    _wait(lambda: _live(env) == 0, 30, "the second attempt's settle")


# -- the hand back's statement, in process -------------------------------------------------


def test_message_rows_reads_pairs_batches_and_a_named_database() -> None:
    token = str(uuid.uuid4())
    assert message_rows([7, token]) == (None, [(7, uuid.UUID(token))])
    assert message_rows(["shard2", [[7, token], [8, token]]]) == (
        "shard2",
        [(7, uuid.UUID(token)), (8, uuid.UUID(token))],
    )
    assert message_rows(["garbage"]) == ("garbage", [])
    assert message_rows(None) == (None, [])


def _row(conn: psycopg.Connection[Any], schema: str, row_id: int) -> tuple[Any, ...]:
    found = conn.execute(
        f"SELECT claim_token, started_at IS NOT NULL, due_at <= now(), attempts, maybe_applied"
        f' FROM "{schema}".outbox WHERE id = %s',
        (row_id,),
    ).fetchone()
    assert found is not None
    return tuple(found)


class _Request:
    """What Leaving reads of Celery's Request: its id, args and whether it was acked."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.id = str(uuid.uuid4())
        self.args = args
        self.acknowledged = False


@pytest.mark.usefixtures("clean")
def test_a_message_received_after_a_warm_shutdown_began_goes_back_at_once(
    dispatcher: Dispatcher, commands: Callable[..., str], schema: str, database_url: str
) -> None:
    """The broker may have sent a message before the consumer stopped: it reaches the worker
    after the warm shutdown began, and its rows go back then, not when the worker exits."""
    cmd = commands(family="bulk")
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(2)])
    first, second = dispatcher.claimer.claim_family(dispatcher.families["bulk"]).claimed
    dispatcher.delivery.on_slot_freed = lambda family, database: None  # no claim task
    leaving = Leaving(lambda database: dispatcher.delivery.slots)
    leaving.received(_Request((first.id, str(first.token))), consumer=None)
    leaving.stopping(cold=False)  # hands back the first
    leaving.received(_Request((second.id, str(second.token))), consumer=None)
    leaving.stopped()  # waits for both hand backs
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            f'SELECT id, due_at <= now() FROM "{schema}".outbox ORDER BY id'
        ).fetchall()
    assert rows == [(ids[0], True), (ids[1], True)]  # both due again, under their claims


@pytest.mark.usefixtures("clean")
def test_a_batch_handed_back_mid_run_keeps_its_started_row_and_frees_the_rest(
    dispatcher: Dispatcher, commands: Callable[..., str], schema: str, database_url: str
) -> None:
    """As a warm shutdown finds a batched message: its first row running, the others not
    started. The others are due at once and their next claim costs no attempt; the running
    row is left to finish, and its settle still holds. Then, as a cold shutdown's end finds
    a started row: it is due at once, and its next claim counts it lost (maybe_applied)."""
    cmd = commands(family="bulk")
    family = dispatcher.families["bulk"]
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(3)])
    claimed = dispatcher.claimer.claim_family(family).claimed
    assert sorted(c.id for c in claimed) == ids
    pairs = [(c.id, c.token) for c in claimed]
    slots = dispatcher.delivery.slots
    # the claim a hand back asks for would be a task the session's worker runs, claiming the
    # rows this test claims by hand: it is noted instead
    woken: list[str] = []
    dispatcher.delivery.on_slot_freed = lambda family, database: woken.append(family)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(  # the first row started, as deliver_begin starts it
            f'UPDATE "{schema}".outbox SET started_at = now(),'
            " due_at = now() + interval '60 seconds' WHERE id = %s",
            (ids[0],),
        )
        handed = hand_back(slots, pairs, lost=False)
        assert sorted((h.id, h.started) for h in handed) == [(ids[1], False), (ids[2], False)]
        assert woken == ["bulk"]  # its claimer is asked for a claim at once
        assert _row(conn, schema, ids[0])[1:3] == (True, False)  # left running
        for i in ids[1:]:
            assert _row(conn, schema, i)[2] is True  # due now
        # the message's own start of a handed-back row is refused
        assert dispatcher.delivery.deliver(*pairs[1], family_hint="bulk").outcome.value == "stale"
        again = {c.id: c for c in dispatcher.claimer.claim_family(family).claimed}
        assert sorted(again) == ids[1:]
        assert [again[i].attempts for i in ids[1:]] == [1, 1]  # uncounted
        # the cut-off row of a cold shutdown: due now, and its next claim counts it lost
        [lost] = hand_back(slots, pairs[:1], lost=True)
        assert (lost.id, lost.started) == (ids[0], True)
        assert hand_back(slots, pairs[:1], lost=True) == []  # once
        [retaken] = dispatcher.claimer.claim_family(family).claimed
        assert (retaken.id, retaken.attempts) == (ids[0], 2)
        assert _row(conn, schema, ids[0])[4] is True  # maybe_applied


@pytest.mark.usefixtures("clean")
def test_handed_back_rows_give_their_cap_slots_back(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """Actor a may hold two slots: a claim takes two rows and sets the third waiting. Handed
    back, the two free their slots, so the next claim takes two rows of the actor again
    (not zero, as it would while the handed-back rows' slots ran to their lease)."""
    cmd = commands(family="cappedbatch")
    family = dispatcher.families["cappedbatch"]
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue_many(conn, [Message(cmd, {}, actor="a") for _ in range(3)])
    first = dispatcher.claimer.claim_family(family).claimed
    assert len(first) == 2
    dispatcher.delivery.on_slot_freed = lambda family, database: None  # no claim task
    assert dispatcher.caps is not None
    assert len(dispatcher.caps.holders("cappedbatch", "a")) == 2
    handed = hand_back(dispatcher.delivery.slots, [(c.id, c.token) for c in first], lost=False)
    assert len(handed) == 2
    assert dispatcher.caps.holders("cappedbatch", "a") == []
    again = dispatcher.claimer.claim_family(family).claimed
    assert len(again) == 2
    assert {c.token for c in again}.isdisjoint({c.token for c in first})
