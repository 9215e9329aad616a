"""A model-based test of the whole outbox against the real Postgres and Redis.

One hypothesis ``RuleBasedStateMachine`` drives a Dispatcher of its own (four families: plain,
capped, ordered with parked rows blocking, ordered with parked rows passing) through its rules:

- ``seed`` (initialize): the example's focus family, a few due rows, maybe a claim of them
  and more rows due behind them;
- ``enqueue``: a row (actor, delay, a dedupe key that may repeat), mostly of the focus;
- ``claim``: a claim of a family (or of all), workers taking its first messages at once;
- ``work``: a waiting message delivered (the handler succeeds, fails, parks, or its worker
  dies in it), started and stalled, or lost; a consumed or lost message arriving late; a
  stalled attempt's heartbeat, its worker coming back to settle, or its message redelivered;
- ``claim_packed`` / ``work_box``: a claim whose rows go out several to a message, as the
  claimer packs a backlog; a worker runs the message with ``deliver_batch`` (each success
  settled by the statement that starts the next row, its cap slot given back right then, the
  last one by the deferred settles at the message's end), each row with its own behaviour; a
  handler that kills the worker leaves the successes before it settled (the last by the
  start of the row that killed it) and the rows after it untouched, and the broker
  redelivers the whole message;
- ``postgres_loses_a_start``: a crash of Postgres loses a stalled attempt's start (which did
  not wait for the disk) and keeps its claim (which did);
- ``cancel``: by id (often of a row whose claim is out) or by actor, committed;
- ``world``: the clock jumps (Postgres by ``store.clock_offset``, Redis slots' scores by the
  same), Redis loses every key, a caps rebuild, maintenance, parked rows retried or purged.

The database is the truth: after every step (and inside every handler) the invariants read
Postgres and Redis directly: each row in exactly one state; no actor over its cap in
Postgres or Redis, no slot without its holder; one head per ordered actor, ahead of the rows
behind it, and rows started in id order; no stale token holding again; cancel requests kept
until honoured; nothing deleted or done without a DELIVERED whose handler returned. The model
only keeps what the handlers did, which tokens are stale, which cancels were asked for, and
which attempts started and were never settled; each rule also predicts its own outcome from
the state it read just before, and checks the state it leaves. At the end, the stalled
workers come back and the outbox must drain: every claim takes what is due.

Time: ``store.clock_offset`` moves every clock the SQL reads, in whole units of 10 s; the
Redis slots' scores move back by the same (Redis TIME cannot be offset), so leases, slots,
backoffs and delays run out without sleeping, and the few hundred ms of real time an example
takes never decide anything. The heartbeat thread is kept out of the way: it renews an entry
a third of the heartbeat timeout (10 s) of wall time after it starts, and a delivery here
takes milliseconds; a stalled attempt is never left in its table (the heartbeat step adds it,
renews it once through the real ``Heartbeats._renew`` and removes it), so every renewal is a
step the model chose.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar
from uuid import UUID

import psycopg
import redis
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from outbox_dispatch import Context, Dispatcher, Outcome, PermanentFailure
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import StopReason
from outbox_dispatch.worker.heartbeat import Running
from outbox_dispatch.worker.slots import LAPSED
from tests.model.invariants import (
    ACTOR_CHOICES,
    ACTORS,
    AMBIG,
    BEAT,
    CMD,
    FAMILIES,
    FAMILY_NAMES,
    LEASE,
    ORDERED,
    PLAIN,
    TOL,
    UNIT,
    Row,
    SlotKey,
    Snapshot,
    check_start,
    heads_of,
    live_claims,
    row,
    run_checks,
)

BEHAVIORS = ("ok", "fail", "park", "crash")  # what a handler does when delivered
FATES = ("ok", "ok", "fail", "park", "crash", "stall", "stall", "lost")  # of a message
WORLD = (
    *("+1", "+2", "+3", "+6"),  # the clock, in units
    *("flush", "flush", "rebuild", "maintenance", "retry parked", "purge parked"),
)
WORK = (
    *FATES,  # of a waiting message
    *("late ok", "late fail"),  # a consumed (or lost) message arrives again
    *("beat", "beat", "resume ok", "resume fail", "resume park", "duplicate"),  # of a stall
)


class _Unwoken(threading.Event):
    """An event that is never set: the deferred settles' thread sleeps for good."""

    def set(self) -> None:
        pass


class WorkerDied(BaseException):
    """Raised by a handler to model its worker dying mid-attempt: nothing below catches it."""


class Violation(BaseException):
    """An invariant failed inside a handler: carried past the delivery (which would take an
    AssertionError for the handler's failure and retry the row) to the rule that called it."""

    def __init__(self, error: AssertionError) -> None:
        super().__init__(str(error))
        self.error = error


# -- the environment: a dispatcher of our own on the session's schema -------------------------

ROWS_SQL = """
SELECT id, family, actor, dedupe_key, attempts, claim_token, started_at IS NOT NULL, waiting,
       blocked, parked_at IS NOT NULL, cancelled_at IS NOT NULL, done_at IS NOT NULL,
       maybe_applied, claimed_at IS NOT NULL,
       coalesce(claim_token IS NOT NULL AND claimed_at < pg_postmaster_start_time(), false),
       CASE WHEN isfinite(due_at) THEN extract(epoch FROM due_at)::float8 END,
       CASE WHEN isfinite(due_at) THEN extract(epoch FROM
            due_at - (now() + make_interval(secs => %(off)s)))::float8 END,
       extract(epoch FROM (now() + make_interval(secs => %(off)s))
            - coalesce(done_at, cancelled_at))::float8
FROM {schema}.outbox ORDER BY id
"""

SHIFT_LUA = """
for _, key in ipairs(KEYS) do
    local members = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
        redis.call('ZADD', key, tonumber(members[i + 1]) - tonumber(ARGV[1]), members[i])
    end
end
return 0
"""


@dataclass
class Env:
    d: Dispatcher
    database_url: str
    schema: str
    prefix: str
    read: psycopg.Connection[Any]  # autocommit: the invariants' reads
    tx: psycopg.Connection[Any]  # the producers' transactions
    r: redis.Redis
    machine: ModelMachine | None = None

    def snapshot(self) -> Snapshot:
        off = self.d.store.clock_offset
        q = ROWS_SQL.format(schema=f'"{self.schema}"')
        rows: dict[int, Row] = {}
        for rec in self.read.execute(q, {"off": off}).fetchall():
            r = replace(Row(*rec[:16]), left=rec[16], settled_for=rec[17])
            rows[r.id] = r
        reqs = self.read.execute(f'SELECT row_id FROM "{self.schema}".outbox_cancel').fetchall()
        assert self.d.caps is not None
        # one SCAN over the whole (small) keyspace, then one round trip for the rest
        keys = sorted(self.keys(f"{self.prefix}:cap:*"))
        with self.r.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.exists(self.d.caps.sentinel)
            for k in keys:
                pipe.zrange(k, 0, -1, withscores=True)
            (sec, usec), sentinel, *found = pipe.execute()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        slots: dict[SlotKey, dict[str, float]] = {}
        odd: list[str] = []
        for k, members in zip(keys, found, strict=True):
            inner = k[len(f"{self.prefix}:cap:") :]
            if not (inner.startswith("{") and inner.endswith("}")) or ":" not in inner:
                odd.append(k)
                continue
            family, actor = inner[1:-1].split(":", 1)
            if family not in FAMILIES:
                odd.append(k)
                continue
            slots[(family, actor)] = {str(m): (float(s) - now_ms) / 1000 for m, s in members}
        requests = frozenset(int(x[0]) for x in reqs)
        return Snapshot(rows, requests, slots, bool(sentinel), tuple(odd))

    def keys(self, pattern: str) -> list[str]:
        return [str(k) for k in self.r.scan_iter(match=pattern, count=100_000)]

    def reset(self) -> None:
        """A clean outbox, no Redis keys, the real clock."""
        self.d.store.clock_offset = 0
        # ids from 1 again: an example replays the same ids (the model picks rows by them)
        tables = f'"{self.schema}".outbox, "{self.schema}".outbox_cancel'
        self.read.execute(f"TRUNCATE {tables} RESTART IDENTITY")
        keys = self.keys(f"{self.prefix}:*")
        if keys:
            self.r.delete(*keys)


def env_handler(env: Env, ctx: Context, payload: Any) -> None:
    assert env.machine is not None, "a handler ran with no model running"
    env.machine.on_handler(ctx)


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Msg:
    """A delivery message: (row id, claim token), with what the model knows of its row."""

    id: int
    token: UUID
    family: str
    actor: str | None

    def __repr__(self) -> str:
        return f"Msg({self.id}, {self.family}, {self.actor}, {str(self.token)[:8]})"


@dataclass
class Attempt:
    """An attempt that started and did not end: its worker died, or stalls and may resume."""

    msg: Msg
    started: Started
    running: Running

    def __repr__(self) -> str:
        return f"Attempt({self.msg!r})"


@dataclass
class Call:
    """One handler run, as the handler saw it."""

    row_id: int
    attempt: int
    token: UUID
    behavior: str
    maybe_applied: bool
    start: float = field(default_factory=time.monotonic)
    end: float | None = None
    returned: bool = False  # it returned normally (what alone may settle a row as delivered)


class ModelMachine(RuleBasedStateMachine):
    env: ClassVar[Env]

    rows = Bundle("rows")

    def __init__(self) -> None:
        super().__init__()
        self.env.reset()
        self.env.machine = self
        self.d = self.env.d
        self.known: set[int] = set()
        self.tokens: dict[int, set[UUID]] = {}
        self.stale: set[tuple[int, UUID]] = set()
        # slots whose releases a killed worker never wrote: they run to their claims'
        # leases, counted against their actors' caps
        self.orphaned: set[str] = set()
        # tokens of stalled attempts whose start a Postgres crash lost: the start's slot check
        # may have renewed the slot for a heartbeat timeout, past the lease the row went back
        # to, and the slot stays while the attempt may still run (its row may be claimed again
        # meanwhile: the new claim waits for the slot)
        self.unrecorded: set[str] = set()
        self.requested: set[int] = set()
        self.delivered: set[int] = set()  # rows settled by a DELIVERED whose handler returned
        self.pruned: set[int] = set()  # settled rows the maintenance pass deleted (or purged)
        self.rejoined: set[int] = set()  # parked rows of a passing line, retried
        self.unresolved: dict[int, UUID] = {}  # row -> token of a started, unsettled attempt
        self.maybe_rows: set[int] = set()  # rows whose next attempts must see maybe_applied
        self.last_attempt: dict[int, int] = {}
        self.calls: list[Call] = []
        self.inbox: list[Msg] = []  # published messages nobody took yet
        self.spent: list[Msg] = []  # taken (or lost) messages, for late duplicates
        self.stalls: list[Attempt] = []  # started attempts whose worker stalls (or died)
        # the delivery in progress
        self.current: Msg | None = None
        self.behavior = "ok"
        self.plan: dict[int, tuple[Msg, str]] = {}  # the batched message in progress
        self.batch_from = 0  # its first handler call
        self.boxes: list[list[Msg]] = []  # batched messages nobody took yet
        self.resuming = False
        self.focus = PLAIN  # set by seed

    # -- helpers --------------------------------------------------------------------------

    def snap(self) -> Snapshot:
        return self.env.snapshot()

    def check(self, snap: Snapshot) -> None:
        run_checks(
            snap,
            stale=self.stale,
            requested=self.requested,
            known=self.known,
            delivered=self.delivered | self.returned_in_batch(),
            pruned=self.pruned,
            rejoined=frozenset(self.rejoined),
            unreleased=self.orphaned | self.held_in_batch() | self.unrecorded,
        )
        for members in snap.slots.values():
            for t in self.unrecorded.intersection(members):
                # a young claim's slot runs to the claim's lease, an old one's was renewed
                assert members[t] <= max(LEASE, BEAT) + TOL, (
                    f"the slot of {t}, whose start a crash lost, outlives its claim and renewal"
                )

    def held_in_batch(self) -> set[str]:
        """Slots of the batched message's returned rows, whose releases the process wrote
        without waiting for Redis's answer (caps/releases.py): Redis may not have run them
        yet when the next row's checks look."""
        return {str(self.plan[rid][0].token) for rid in self.returned_in_batch()}

    def returned_in_batch(self) -> set[int]:
        """Rows of the batched message in progress whose handler returned: the next row's
        checks may see them settled before the batch is judged."""
        if not self.plan:
            return set()
        return {c.row_id for c in self.calls[self.batch_from :] if c.returned}

    def slot_left(self, snap: Snapshot, msg: Msg) -> float | None:
        assert msg.actor is not None
        return snap.slots.get((msg.family, msg.actor), {}).get(str(msg.token))

    def unsure(self, r: Row) -> bool:
        """Whether the row's claim may hide a start a Postgres crash lost: its family's
        starts do not flush, and it was claimed before the server's start."""
        return r.unsure and not self.d.store.starts_flushed(FAMILIES[r.family])

    def capped(self, msg: Msg) -> bool:
        return FAMILIES[msg.family].per_actor is not None and msg.actor is not None

    def predict_start(self, snap: Snapshot, msg: Msg) -> str | None:
        """What a delivery's start does with this message: "stale" (begin refuses it),
        "handback" (begun, but its cap slot lapsed), "start", or None (too close to call)."""
        r = snap.rows.get(msg.id)
        if r is None or r.token != msg.token or r.started or r.waiting or self.unsure(r):
            return "stale"
        assert r.left is not None, f"row {r.id} is claimed at infinity"
        if r.left <= 0:
            return "stale"
        if r.left <= AMBIG:
            return None
        if self.capped(msg):
            left = self.slot_left(snap, msg)
            if left is not None and left > AMBIG:
                return "start"
            if left is not None and left > 0:
                return None
            # gone or expired: renew says -1 (being rebuilt: go on) without the sentinel
            return "handback" if snap.sentinel else "start"
        return "start"

    def settle_outcome(self, has_request: bool, kind: str) -> Outcome:
        if has_request:
            return Outcome.CANCELLED
        return {"delete": Outcome.DELIVERED, "retry": Outcome.RETRIED, "park": Outcome.PARKED}[kind]

    def failure_kind(self, family: str, attempts: int) -> str:
        fam = FAMILIES[family]
        return "park" if fam.max_attempts is not None and attempts >= fam.max_attempts else "retry"

    def retire(self, rid: int, token: UUID) -> None:
        """The attempt under ``token`` settled: the token is stale from now."""
        self.stale.add((rid, token))
        if self.unresolved.get(rid) == token:
            del self.unresolved[rid]

    def note_start(self, rid: int, attempt: int, maybe_applied: bool) -> None:
        """An attempt started (in a handler, or a begin the worker died after)."""
        snap = self.snap()
        self.check(snap)
        check_start(snap, rid, attempt, self.last_attempt.get(rid), frozenset(self.rejoined))
        self.last_attempt[rid] = attempt
        assert maybe_applied == (rid in self.maybe_rows), (
            f"row {rid}: attempt {attempt} sees maybe_applied={maybe_applied}, but "
            + ("an earlier attempt was lost" if rid in self.maybe_rows else "none was lost")
        )

    def on_handler(self, ctx: Context) -> None:
        if self.plan:  # a batched message: each row has its own message and behaviour
            assert ctx.row_id in self.plan, f"handler of row {ctx.row_id} ran outside its batch"
            self.current, self.behavior = self.plan[ctx.row_id]
        cur = self.current
        assert cur is not None and ctx.row_id == cur.id, (
            f"handler of row {ctx.row_id} ran outside a delivery of it ({cur})"
        )
        if not self.resuming:
            try:
                self.note_start(ctx.row_id, ctx.attempt, ctx.maybe_applied)
            except AssertionError as exc:
                raise Violation(exc) from exc
        call = Call(ctx.row_id, ctx.attempt, cur.token, self.behavior, ctx.maybe_applied)
        self.calls.append(call)
        call.end = time.monotonic()
        if self.behavior == "fail":
            raise RuntimeError(f"handler of row {ctx.row_id} fails")
        if self.behavior == "park":
            raise PermanentFailure(f"row {ctx.row_id} cannot be done")
        if self.behavior == "crash":
            raise WorkerDied()
        call.returned = True

    # -- enqueue --------------------------------------------------------------------------

    def _enqueue(self, family: str, actor: str | None, delay: int, dedupe: str | None) -> int:
        if family == PLAIN:
            actor = None
        elif family in ORDERED and actor is None:
            actor = ACTORS[0]
        before = self.snap()
        holder = [r.id for r in before.rows.values() if dedupe and r.dedupe_key == dedupe]
        with self.env.tx.transaction():
            rid = self.d.enqueue(
                self.env.tx,
                CMD[family],
                {"family": family},
                actor=actor,
                dedupe_key=dedupe,
                delay=timedelta(seconds=delay * UNIT) if delay else None,
            )
        if holder:
            assert rid == holder[0], f"dedupe key {dedupe} names row {holder[0]}, got {rid}"
            return rid
        assert rid not in self.known, f"enqueue returned row {rid} again"
        self.known.add(rid)
        self.tokens[rid] = set()
        after = self.snap().rows[rid]
        fam = FAMILIES[family]
        if fam.ordered:
            line = [
                r.id
                for r in before.actor_rows(family, actor or "")
                if r.live or (r.parked and fam.parked_blocks)
            ]
            assert after.blocked == bool(line), (
                f"row {rid}: blocked={after.blocked}, with rows {line} in its actor's line"
            )
        if not after.blocked:
            assert after.left is not None and abs(after.left - delay * UNIT) < 1.0, after
        return rid

    @rule(
        target=rows,
        family=st.sampled_from((*["focus"] * 4, *FAMILY_NAMES)),
        actor=st.sampled_from(ACTOR_CHOICES),
        delay=st.sampled_from([0, 0, 0, 2, 4]),  # units
        dedupe=st.sampled_from([None, None, None, "k1", "k2"]),
    )
    def enqueue(self, family: str, actor: str | None, delay: int, dedupe: str | None) -> int:
        """A producer's row, mostly of the focus family: the plain family has no actors, an
        ordered row always has one (the actor None is read as "a" there)."""
        return self._enqueue(self.focus if family == "focus" else family, actor, delay, dedupe)

    @initialize(
        target=rows,
        focus=st.sampled_from(FAMILY_NAMES),
        actors=st.lists(st.sampled_from(ACTOR_CHOICES), min_size=1, max_size=4),
        then=st.lists(st.sampled_from(ACTOR_CHOICES), max_size=3),
    )
    def seed(
        self, focus: str, actors: list[str | None], then: list[str | None]
    ) -> MultipleResults[int]:
        """The example's focus: the family most of its enqueues and claims go to (interactions
        happen within a family); a few of its rows, due at once, so that there is work; and,
        when ``then`` names more, a claim of the first ones (their messages wait in the
        broker) before those are enqueued, due behind them."""
        self.focus = focus
        ids = [self._enqueue(focus, actor, 0, None) for actor in actors]
        if then:
            self.inbox += self._claim(focus)
            ids += [self._enqueue(focus, actor, 0, None) for actor in then]
        return multiple(*ids)

    # -- claim ----------------------------------------------------------------------------

    def _claim(self, family: str, *, all_lapsed: bool = False) -> list[Msg]:
        """A claim of one family. ``all_lapsed``: every lease and slot ran out (the drain),
        so a capped actor with due rows must get one of them."""
        fam = FAMILIES[family]
        before = self.snap()
        result = self.d.claimer.claim_family(self.d.families[family])
        after = self.snap()
        taken = [c.id for c in result.claimed] + list(result.parked)
        assert len(taken) == len(set(taken)), f"a claim took a row twice: {taken}"
        msgs: list[Msg] = []
        for rid in taken:
            b = before.rows.get(rid)
            assert b is not None and b.family == family and b.live and not b.blocked, (
                f"claim of {family} took row {rid}, which is {b}"
            )
            assert b.left is not None and (b.left <= AMBIG or b.waiting), (
                f"claim of {family} took row {rid}, due in {b.left} s"
            )
            self.stale |= {(rid, t) for t in self.tokens[rid]}
            if rid in self.unresolved:  # its started attempt was lost
                del self.unresolved[rid]
                self.maybe_rows.add(rid)
            elif rid in result.parked:
                raise AssertionError(f"row {rid} parked at claim, but no attempt of it was lost")
        for c in result.claimed:
            b = before.rows[c.id]
            assert c.token not in self.tokens[c.id], f"row {c.id} claimed under an old token"
            self.tokens[c.id].add(c.token)
            kept = b.token is not None and not b.started and not self.unsure(b)
            assert c.attempts == b.attempts + (0 if kept else 1), (
                f"row {c.id}: claimed as attempt {c.attempts} after {b.attempts} "
                f"(token held {b.token is not None}, started {b.started})"
            )
            a = after.rows[c.id]
            assert a.token == c.token and a.left is not None and a.left > LEASE - 1, a
            msgs.append(Msg(c.id, c.token, family, c.actor))
        for rid in result.parked:
            assert after.rows[rid].parked, f"row {rid} reported parked, is {after.rows[rid]}"
        if fam.per_actor is not None and after.sentinel:
            # the slots of started attempts whose lease ran out went back before slots were taken
            dead = {
                str(r.token)
                for r in before.rows.values()
                if r.family == family and r.started and r.left is not None and r.left <= 0
            }
            still = [
                t
                for (f, _), members in after.slots.items()
                if f == family
                for t, t_left in members.items()
                if t in dead and t_left > TOL
            ]
            assert not still, f"claim of {family} kept the slots of lapsed holders {still}"
        # liveness: a due row is taken by the next claim
        due = [
            r
            for r in before.rows.values()
            if r.family == family
            and r.live
            and not r.blocked
            and not r.waiting
            and r.left is not None
            and r.left <= 0
        ]
        if fam.per_actor is None:
            missed = [r.id for r in due if r.id not in taken]
            full = len(live_claims(after, family, 0)) >= fam.max_in_flight
            assert not missed or full, f"claim of {family} left due rows {missed}"
        elif all_lapsed:
            due += [
                r
                for r in before.rows.values()
                if r.family == family
                and r.live
                and r.waiting
                and r.left is not None
                and r.left <= 0
            ]
            missed = [r.id for r in due if r.actor is None and r.id not in taken]
            assert not missed, f"claim of {family} left due rows without an actor: {missed}"
            for actor in {r.actor for r in due if r.actor is not None}:
                got = [rid for rid in taken if before.rows[rid].actor == actor]
                assert len(got) == 1, f"claim of {family}: actor {actor} got rows {got}"
        return msgs

    @rule(
        family=st.sampled_from((*["focus"] * 4, *FAMILY_NAMES, "all")),
        fates=st.lists(st.sampled_from((*FATES, "stall", "hold", "hold")), min_size=1, max_size=3),
    )
    def claim(self, family: str, fates: list[str]) -> None:
        """A claim of one family (mostly the focus; or a claimer pass over all) publishes its
        messages; workers take the first ones at once (``fates``: see consume), the rest wait
        in the broker."""
        name = self.focus if family == "focus" else family
        families = FAMILY_NAMES if name == "all" else (name,)
        msgs = [m for name in families for m in self._claim(name)]
        for k, msg in enumerate(msgs):
            fate = fates[k] if k < len(fates) else "hold"
            if fate == "hold":
                self.inbox.append(msg)
            else:
                self._consume(msg, fate)

    def _consume(self, msg: Msg, fate: str) -> None:
        if fate in BEHAVIORS:
            self._deliver(msg, fate)
        elif fate == "stall":
            self._begin_only(msg)
        self.spent.append(msg)

    # -- delivery -------------------------------------------------------------------------

    def _deliver(self, msg: Msg, behavior: str) -> Outcome | None:
        """deliver() of a message, its outcome predicted from the state just before."""
        before = self.snap()
        start = self.predict_start(before, msg)
        outcome, crashed, calls = self._run_delivery(msg, behavior)
        self._judge(msg, behavior, start, before, self.snap(), calls, outcome, crashed)
        return outcome

    def _run_delivery(self, msg: Msg, behavior: str) -> tuple[Outcome | None, bool, list[Call]]:
        """deliver() of a message whose handler behaves as told: its outcome (None when the
        worker died in the handler), whether it died, and the handler calls it made."""
        self.current, self.behavior, self.resuming = msg, behavior, False
        n_calls = len(self.calls)
        try:
            result = self.d.delivery.deliver(msg.id, msg.token, family_hint=msg.family)
        except WorkerDied:
            return None, True, self.calls[n_calls:]
        except Violation as v:
            raise v.error from None
        finally:
            self.current = None
        return result.outcome, False, self.calls[n_calls:]

    def _judge(
        self,
        msg: Msg,
        behavior: str,
        start: str | None,
        before: Snapshot,
        after: Snapshot,
        calls: list[Call],
        outcome: Outcome | None,
        crashed: bool,
    ) -> None:
        """One row's delivery against what the state before it predicted (``start``), from
        its handler calls and the state after."""
        b = before.rows.get(msg.id)
        a = after.rows.get(msg.id)
        assert len(calls) <= 1, f"one delivery ran {len(calls)} handlers"
        assert outcome is not Outcome.LOST, "a synchronous delivery lost its own claim"
        if start in ("stale", "handback"):
            assert outcome is Outcome.STALE and not calls, (
                f"{msg}: expected stale ({start}), got {outcome}, ran {calls}"
            )
        if outcome is Outcome.STALE:
            assert not calls, f"{msg}: a stale message ran its handler"
            assert b is not None or a is None
            if b is not None and b.token == msg.token and a is not None and a.token is None:
                # begun, then handed back: the slot lapsed before it could start
                assert start in ("handback", None), f"{msg}: handed back, predicted {start}"
                assert self.capped(msg) and a.attempts == max(b.attempts - 1, 0), (b, a)
                assert not a.started and a.left is not None and a.left <= AMBIG, a
                self.retire(msg.id, msg.token)
            else:
                assert a == b, f"{msg}: a stale delivery changed its row:\n{b}\n{a}"
                assert (msg.id in before.requests) == (msg.id in after.requests)
            return
        assert b is not None
        if start == "start" and msg.id in before.requests:
            assert outcome is Outcome.CANCELLED and not calls, (outcome, calls)
        if crashed:
            assert calls and calls[0].behavior == "crash"
            assert a is not None and a.token == msg.token and a.started, a
            self.unresolved[msg.id] = msg.token
            return
        assert outcome is not None
        if outcome is not Outcome.CANCELLED or calls:
            assert calls, f"{msg}: outcome {outcome} without running the handler"
        if calls:
            kind = {"ok": "delete", "park": "park"}.get(behavior) or self.failure_kind(
                msg.family, b.attempts
            )
            expected = self.settle_outcome(msg.id in before.requests, kind)
            assert outcome is expected, f"{msg} ({behavior}): expected {expected}, got {outcome}"
        if outcome is Outcome.DELIVERED:
            assert calls and calls[0].returned, f"{msg}: delivered, but its handler did not return"
            assert msg.id not in self.delivered, f"row {msg.id} delivered twice"
            self.delivered.add(msg.id)
            fam = FAMILIES[msg.family]
            assert (a is None) if fam.retention == 0 else (a is not None and a.done), a
        elif outcome is Outcome.RETRIED:
            assert a is not None and a.live and a.token is None and not a.started, a
            assert a.attempts == b.attempts and a.left is not None and a.left > UNIT - 1, a
        elif outcome is Outcome.PARKED:
            assert a is not None and a.parked, a
        elif outcome is Outcome.CANCELLED:
            assert a is not None and a.cancelled and msg.id not in after.requests, a
        self.retire(msg.id, msg.token)
        if self.capped(msg) and str(msg.token) not in self.orphaned:
            left = self.slot_left(after, msg)
            assert left is None, f"{msg}: settled, its slot is still there ({left} s)"

    # -- batched messages -----------------------------------------------------------------

    @rule(
        family=st.sampled_from((*["focus"] * 4, *FAMILY_NAMES)),
        size=st.integers(2, 4),
        acts=st.lists(st.sampled_from((*BEHAVIORS, "ok", "ok")), min_size=4, max_size=4),
        hold=st.booleans(),
    )
    def claim_packed(self, family: str, size: int, acts: list[str], hold: bool) -> None:
        """A claim whose rows go out ``size`` to a message, as the claimer packs a backlog
        (policy.rows_per_message); a worker takes the first message at once (``acts``: what
        each row's handler does) unless ``hold``, and the rest wait in the broker."""
        msgs = self._claim(self.focus if family == "focus" else family)
        boxes = [msgs[k : k + size] for k in range(0, len(msgs), size)]
        if boxes and not hold:
            self._deliver_box(boxes.pop(0), acts)
        self.boxes += boxes

    @precondition(lambda self: bool(self.boxes))
    @rule(
        i=st.integers(0, 7),
        acts=st.lists(st.sampled_from((*BEHAVIORS, "ok", "ok")), min_size=4, max_size=4),
    )
    def work_box(self, i: int, acts: list[str]) -> None:
        """A worker takes the i-th waiting batched message."""
        self._deliver_box(self.boxes.pop(i % len(self.boxes)), acts)

    def _deliver_box(self, msgs: list[Msg], acts: list[str]) -> None:
        """deliver_batch() of one message of several rows, as a worker runs it (each success
        settled by the next row's start, the last in a deferred statement at its end). A
        handler that kills the worker takes the process with it: the successes before it were
        settled by the starts after them (the last by the start of the row that killed it),
        the rows after it never began (unchanged), and the broker redelivers the whole message
        (acks_late, reject_on_worker_lost)."""
        before = self.snap()
        starts = {m.id: self.predict_start(before, m) for m in msgs}
        self.plan = {m.id: (m, acts[k % len(acts)]) for k, m in enumerate(msgs)}
        results: dict[int, Outcome] = {}
        delivery = self.d.delivery
        one_row = delivery.deliver

        def seen(row_id: int, token: UUID, **kw: Any) -> Any:
            res = one_row(row_id, token, **kw)
            results[row_id] = res.outcome
            return res

        n_calls = self.batch_from = len(self.calls)
        crashed = False
        delivery.deliver = seen  # type: ignore[method-assign]  # observed, not replaced
        try:
            pairs = [(m.id, m.token) for m in msgs]
            delivery.deliver_batch(pairs, family_hint=msgs[0].family, defer=True)
        except WorkerDied:
            crashed = True
            delivery.deferred._pending.clear()  # the process died, its deferred settles too
            delivery.deferred._after.clear()
        except Violation as v:
            raise v.error from None
        finally:
            del delivery.deliver
            self.plan, self.current = {}, None
        calls = self.calls[n_calls:]
        after = self.snap()
        ran = [c.row_id for c in calls]
        assert ran == [m.id for m in msgs if m.id in ran] and len(set(ran)) == len(ran), (
            f"a batch of {[m.id for m in msgs]} ran handlers out of order: {ran}"
        )
        last = len(msgs) - 1
        if crashed:
            assert calls and calls[-1].behavior == "crash", calls
            last = [m.id for m in msgs].index(calls[-1].row_id)
            for m in msgs[last + 1 :]:  # never began: a kill marks only the rows it started
                assert after.rows.get(m.id) == before.rows.get(m.id), (
                    f"{m}: after a kill earlier in its batch, its row changed:\n"
                    f"{before.rows.get(m.id)}\n{after.rows.get(m.id)}"
                )
        for k, m in enumerate(msgs[: last + 1]):
            behavior = acts[k % len(acts)]
            mine = [c for c in calls if c.row_id == m.id]
            outcome = results.get(m.id)
            if crashed and k == last:
                self._judge(m, behavior, starts[m.id], before, after, mine, None, True)
            else:
                self._judge(m, behavior, starts[m.id], before, after, mine, outcome, False)
        self.spent += msgs
        if crashed:
            self.boxes.append(msgs)

    @precondition(lambda self: bool(self.inbox or self.spent or self.stalls))
    @rule(fate=st.sampled_from(WORK), i=st.integers(0, 7))
    def work(self, fate: str, i: int) -> None:
        """What happens to the i-th message or attempt in flight (nothing, if there is none of
        the kind): a worker takes a waiting message (``FATES``); a consumed or lost message
        arrives (again) late; a stalled attempt's heartbeat renews it, its worker comes back
        and settles, or the broker redelivers its message (its worker vanished): a duplicate
        must not run."""
        if fate in FATES:
            if self.inbox:
                self._consume(self.inbox.pop(i % len(self.inbox)), fate)
        elif fate.startswith("late "):
            if self.spent:
                self._deliver(self.spent[i % len(self.spent)], fate.removeprefix("late "))
        elif self.stalls:
            att = self.stalls[i % len(self.stalls)]
            if fate == "beat":
                self._heartbeat(att)
            elif fate == "duplicate":
                assert self._deliver(att.msg, "ok") is Outcome.STALE
            else:
                self.stalls.remove(att)
                self._resume(att, fate.removeprefix("resume "))

    def _begin_only(self, msg: Msg) -> None:
        """A worker starts the attempt (begin, slot check) and then stalls or dies."""
        before = self.snap()
        start = self.predict_start(before, msg)
        fam = self.d.families[msg.family]
        flushed = self.d.store.starts_flushed(fam)
        started = self.d.store.begin(msg.id, msg.token, fam.heartbeat_timeout, flushed=flushed)
        if started is None:
            assert start in ("stale", None), f"{msg}: begin refused, predicted {start}"
            return
        assert start != "stale", f"{msg}: begin accepted a stale message"
        held = self.d.delivery._check_slot(started, fam)
        if held == LAPSED:
            assert start in ("handback", None), f"{msg}: handed back, predicted {start}"
            self.retire(msg.id, msg.token)
            return
        assert start in ("start", None), f"{msg}: started, predicted {start}"
        self.note_start(msg.id, started.attempts, started.maybe_applied)
        self.unresolved[msg.id] = msg.token
        _ctx, running = self.d.delivery._context(started, fam, held=held)
        running.next_at = math.inf  # never the heartbeat thread's to renew
        self.stalls.append(Attempt(msg, started, running))

    def _heartbeat(self, att: Attempt) -> None:
        """The stalled attempt's heartbeat renews its lease (and slot) once."""
        before = self.snap()
        msg, running = att.msg, att.running
        b = before.rows.get(msg.id)
        was = (running.holds, running.stop)
        beats = self.d.delivery.heartbeats
        beats.add(running)
        try:
            beats._renew([running])
        finally:
            beats.remove(running)
        running.next_at = math.inf
        after = self.snap()
        a = after.rows.get(msg.id)
        if not was[0]:  # no longer a holder: nothing is renewed
            assert a == b and (running.holds, running.stop) == was
            return
        slot = "held"
        if self.capped(msg):
            left = self.slot_left(before, msg)
            if left is not None and 0 < left <= AMBIG:
                return
            if left is None or left <= 0:
                slot = "lapsed" if before.sentinel else "held"
        if slot == "lapsed":
            assert running.stop is StopReason.SLOT_LAPSED and not running.holds, running.stop
            assert a == b, "a lapsed slot's lease was renewed"
            return
        current = b is not None and b.token == msg.token and b.left is not None
        if current and b is not None and b.left is not None and 0 < b.left <= AMBIG:
            return
        if current and b is not None and b.left is not None and b.left > 0:
            assert running.holds and a is not None and a.left is not None, (running, a)
            assert a.left > BEAT - 1, f"{msg}: renewed to {a.left} s"
            if msg.id in before.requests:
                assert running.stop is StopReason.CANCEL_REQUESTED, running.stop
        else:
            assert running.stop is StopReason.CLAIM_LOST and not running.holds, (
                f"{msg}: a lapsed lease was renewed (stop={running.stop}, row {a})"
            )
            assert a == b, f"{msg}: a lost claim's row changed on renewal"

    def _resume(self, att: Attempt, behavior: str) -> None:
        """The stalled worker comes back: its handler returns (or raises) and it settles, fenced
        by its token. Under a token that no longer holds, the settle must change nothing."""
        before = self.snap()
        msg, running = att.msg, att.running
        b = before.rows.get(msg.id)
        fam = self.d.families[msg.family]
        fn = self.d.registry.handler(CMD[msg.family])
        assert fn is not None
        stop = running.stop
        self.current, self.behavior, self.resuming = msg, behavior, True
        n_calls = len(self.calls)
        beats = self.d.delivery.heartbeats
        beats.add(running)
        try:
            outcome = self.d.delivery._run(att.started, fam, fn, running, defer=False).outcome
        finally:
            beats.remove(running)
            self.current, self.resuming = None, False
        calls = self.calls[n_calls:]
        assert len(calls) == 1
        after = self.snap()
        a = after.rows.get(msg.id)
        told_to_stop = stop is not None and stop is not StopReason.CANCEL_REQUESTED
        if behavior == "park":
            kind = "park"
        elif behavior == "fail" or told_to_stop:
            kind = self.failure_kind(msg.family, att.started.attempts)
        else:
            kind = "delete"
        holds = b is not None and b.token == msg.token
        if not holds:
            assert outcome is Outcome.LOST, f"{msg}: settled {outcome} under a stale token"
            assert a == b, f"{msg}: a settle under a stale token changed the row:\n{b}\n{a}"
            assert (msg.id in before.requests) == (msg.id in after.requests), (
                f"{msg}: a settle under a stale token removed row {msg.id}'s cancel request"
            )
            return
        assert b is not None
        expected = self.settle_outcome(msg.id in before.requests, kind)
        assert outcome is expected, f"{msg} ({behavior}, {stop}): expected {expected}, {outcome}"
        if outcome is Outcome.DELIVERED:
            assert calls[0].returned
            assert msg.id not in self.delivered, f"row {msg.id} delivered twice"
            self.delivered.add(msg.id)
        if outcome is Outcome.RETRIED and behavior == "ok":
            self.maybe_rows.add(msg.id)  # it returned after being told to stop
            assert a is not None and a.maybe_applied
        self.retire(msg.id, msg.token)

    @precondition(lambda self: bool(self.stalls))
    @rule(i=st.integers(0, 7))
    def postgres_loses_a_start(self, i: int) -> None:
        """A crash of Postgres loses a stalled attempt's start, which did not wait for the disk
        (its family's starts do not flush), while the claim before it, which did, survives:
        the row is left claimed before the server's start and not started, its lease the
        claim's (which the start had shortened to the heartbeat timeout). The attempt may
        have run, so no message may start the row again (the duplicate and late messages of
        ``work``), and its next attempt must see maybe_applied. What the crash leaves is
        written to the row; the shared server is not restarted."""
        att = self.stalls[i % len(self.stalls)]
        msg = att.msg
        if self.d.store.starts_flushed(FAMILIES[msg.family]):
            return  # its start waited for the disk: no crash loses it
        b = self.snap().rows.get(msg.id)
        if b is None or b.token != msg.token or not b.started:
            return
        self.env.read.execute(
            f'UPDATE "{self.env.schema}".outbox SET started_at = NULL, '
            "due_at = claimed_at + make_interval(secs => %s), "
            "claimed_at = pg_postmaster_start_time() - interval '1 second' "
            "WHERE id = %s AND claim_token = %s",
            (FAMILIES[msg.family].lease, msg.id, msg.token),
        )
        self.unrecorded.add(str(msg.token))
        after = self.snap()
        a = after.rows[msg.id]
        assert a.unsure and not a.started, a
        self.check(after)

    # -- cancel ---------------------------------------------------------------------------

    def _cancel(self, rid: int | None, actor: str | None) -> None:
        before = self.snap()
        matched = [
            r
            for r in before.rows.values()
            if r.live and (r.id == rid if rid is not None else r.actor == actor)
        ]
        with self.env.tx.transaction():
            result = self.d.cancel(self.env.tx, rid, actor=actor, reason="model")
        after = self.snap()
        assert sorted(result.cancelled + result.requested) == [r.id for r in matched], (
            result,
            matched,
        )
        for r in matched:
            # cancel_now: no claim, or a claim that never started and whose lease ran out
            free = r.token is None or (not r.started and r.left is not None and r.left <= 0)
            unsure = r.token is not None and not r.started and 0 < (r.left or 0) <= AMBIG
            if r.id in result.cancelled:
                assert free or unsure, f"row {r.id} cancelled at once while held: {r}"
                a = after.rows[r.id]
                assert a.cancelled and a.token is None and r.id not in after.requests, a
                self.stale |= {(r.id, t) for t in self.tokens[r.id]}
                self.unresolved.pop(r.id, None)
            else:
                assert not free, f"row {r.id} is free, only a request was made: {r}"
                assert r.id in after.requests
                self.requested.add(r.id)

    @rule(rid=rows, how=st.sampled_from(["id", "held", "held", "actor"]), i=st.integers(0, 3))
    def cancel(self, rid: int, how: str, i: int) -> None:
        """Cancel one row by id (``held``: the i-th of the rows whose claim is out, if any),
        or every unsettled row of that row's actor."""
        snap = self.snap()
        if how == "held":
            held = sorted(r.id for r in snap.rows.values() if r.token is not None)
            rid = held[i % len(held)] if held else rid
        actor = snap.rows.get(rid, row(rid)).actor if how == "actor" else None
        if actor is None:
            self._cancel(rid, None)
        else:
            self._cancel(None, actor)

    def _advance(self, seconds: float) -> None:
        store = self.d.store
        store.clock_offset = store.clock_offset + seconds
        keys = self.env.keys(f"{self.env.prefix}:cap:*")
        if keys:
            self.env.r.eval(SHIFT_LUA, len(keys), *keys, int(seconds * 1000))

    @rule(op=st.sampled_from(WORLD))
    def world(self, op: str) -> None:
        """Time passes (leases, slots, backoffs and delays run out); Redis loses every key
        (a restart without persistence: the sentinel too); an explicit caps rebuild; the
        periodic maintenance pass (prune settled rows, repair lines); an operator retries or
        purges the parked rows."""
        if op.startswith("+"):
            self._advance(int(op[1:]) * UNIT)
        elif op == "flush":
            keys = self.env.keys(f"{self.env.prefix}:*")
            if keys:
                self.env.r.delete(*keys)
        elif op == "rebuild":
            self.d.claimer.rebuild_caps()
        elif op in ("retry parked", "purge parked"):
            self._parked(op == "retry parked")
        else:
            before = self.snap()
            self.d.ops.prune()
            after = self.snap()
            for rid, r in before.rows.items():
                if rid not in after.rows:
                    assert r.done or r.cancelled, f"maintenance deleted row {rid}: {r}"
                    age, keep = r.settled_for, FAMILIES[r.family].retention
                    assert age is not None and age > keep - AMBIG, f"row {rid} pruned at {age} s"
                    self.pruned.add(rid)
            for r in after.rows.values():
                assert r.settled_for is None or r.settled_for < FAMILIES[r.family].retention, (
                    f"row {r.id} outlived its retention: {r}"
                )

    def _parked(self, retry: bool) -> None:
        before = self.snap()
        parked = sorted(r.id for r in before.rows.values() if r.parked)
        if retry:
            assert sorted(self.d.ops.parked_retry()) == parked
        else:
            assert sorted(self.d.ops.parked_purge()) == parked
        after = self.snap()
        for rid in parked:
            a = after.rows.get(rid)
            if not retry:
                assert a is None, f"row {rid} purged, still there: {a}"
                self.pruned.add(rid)
                continue
            assert a is not None and a.live and a.attempts == 0 and a.token is None, a
            assert a.blocked or (a.left is not None and a.left <= AMBIG), a
            self.last_attempt.pop(rid, None)  # attempts start over
            if not FAMILIES[a.family].parked_blocks:
                self.rejoined.add(rid)

    # -- invariants and the end -----------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.check(self.snap())

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None:  # a failed step is reported as it is
                self.drain()
        finally:
            self.env.machine = None

    def drain(self) -> None:
        """Liveness: the stalled workers come back; then, with time passing and every handler
        succeeding, each claim takes what is due and the outbox drains to settled rows (and
        rows behind a parked head of a line whose parked rows block) within one pass per row
        of the longest line."""
        for k, att in enumerate(self.stalls):  # the stalled workers come back, and settle
            if k % 2 == 0:
                self._heartbeat(att)  # a heartbeat first: it may tell the handler to stop
            self._resume(att, "ok")
            self.check(self.snap())
        self.stalls.clear()
        while self.boxes:  # the batched messages still waiting are taken, every row succeeding
            self._deliver_box(self.boxes.pop(0), ["ok"])
            self.check(self.snap())
        snap = self.snap()
        backlog = Counter((r.family, r.actor) for r in snap.rows.values() if r.live)
        passes = max(backlog.values(), default=0) + 3
        for _ in range(passes):
            snap = self.snap()
            pending = [r.id for r in snap.rows.values() if r.live and not self.stuck(snap, r)]
            if not pending:
                return
            self._advance(LEASE + UNIT)  # every lease, slot, backoff and delay ran out
            for family in FAMILY_NAMES:
                for msg in self._claim(family, all_lapsed=True):
                    self._deliver(msg, "ok")
                self.check(self.snap())
        snap = self.snap()
        left = [r for r in snap.rows.values() if r.live and not self.stuck(snap, r)]
        raise AssertionError(f"the outbox did not drain in {passes} passes: {left}")

    def stuck(self, snap: Snapshot, r: Row) -> bool:
        """Waits behind its actor's parked head, as a line whose parked rows block does."""
        if not (r.blocked and FAMILIES[r.family].parked_blocks and r.actor is not None):
            return False
        heads, _ = heads_of(snap, r.family, r.actor)
        return bool(heads) and heads[0].parked
