"""The model test's families and invariants: what the database holds (``Row``, ``Snapshot``)
and the invariants as checks of a snapshot, pure: machine.py runs them after every step and
inside every handler, test_invariants.py feeds them bad states."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from outbox_dispatch import Backoff, Family, LostAttempt

# -- the families under test ----------------------------------------------------------------

# Every duration is a multiple of UNIT seconds of the shifted clock, and the model only ever
# moves the clock by whole units: real time (a few hundred ms per example) never decides
# whether a lease ran out, so an example replays the same way (hypothesis requires it).
UNIT = 10.0
LEASE = 5 * UNIT  # how long a claimed message may wait before it starts
BEAT = 3 * UNIT  # heartbeat timeout: a started attempt's lease
PLAIN, CAPPED, LINED, PASSING = "mplain", "mcapped", "mlined", "mpassing"
FAMILY_NAMES = (PLAIN, CAPPED, LINED, PASSING)
ORDERED = (LINED, PASSING)
CMD = {name: f"model.{name}" for name in FAMILY_NAMES}
ACTORS = ("a", "b")
ACTOR_CHOICES = ("a", "a", "b", None)  # mostly one actor: its rows meet at its cap or line
QUICK = Backoff(base=UNIT, cap=2 * UNIT, jitter=0.0)  # a retry is scheduled, for 1 or 2 units

COMMON: dict[str, Any] = {"backoff": QUICK, "lease": LEASE, "heartbeat_timeout": BEAT}
SPECS: dict[str, dict[str, Any]] = {
    PLAIN: {"max_attempts": 3, "max_in_flight": 3},  # small: claims and starts meet it
    # delivered rows stay, done, for 20 units (and keep their dedupe keys)
    CAPPED: {"max_attempts": 3, "per_actor": 1, "retention": 20 * UNIT},
    LINED: {"max_attempts": 2, "ordered": True},  # a parked row holds its actor's line
    PASSING: {
        "max_attempts": 2,
        "ordered": True,
        "parked_blocks": False,
        "on_lost": LostAttempt.PARK,  # a lost attempt parks its row at the next claim
    },
}
FAMILIES = {name: Family(name, **COMMON, **spec) for name, spec in SPECS.items()}

# A holder whose lease ends within TOL is not counted against its cap: the slot is taken in
# Redis a round trip before the row's lease starts in Postgres (and renewed a round trip before
# it), so the two ends are that far apart; a real overlap is whole seconds (clock steps).
TOL = 0.25
# A lease or slot ending within AMBIG may end between the model's read and the statement that
# decides: the model makes no prediction then (time only moves forward, so <= 0 is certain).
AMBIG = 0.1


# -- what the database holds ---------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: int
    family: str
    actor: str | None
    dedupe_key: str | None
    attempts: int
    token: UUID | None
    started: bool
    waiting: bool
    blocked: bool
    parked: bool
    cancelled: bool
    done: bool
    maybe_applied: bool
    claimed: bool
    unsure: bool  # claimed before Postgres last started: a crash may have lost its start
    due: float | None  # due_at, epoch seconds; None for infinity
    left: float | None = field(default=None, compare=False)  # due_at - now (+offset)
    settled_for: float | None = field(default=None, compare=False)  # since done or cancelled

    @property
    def settled(self) -> bool:
        return self.parked or self.cancelled or self.done

    @property
    def live(self) -> bool:
        return not self.settled


def row(rid: int, family: str = PLAIN, **kw: Any) -> Row:
    """A row as the unit checks below build them: live and due unless told otherwise."""
    base: dict[str, Any] = {
        "actor": None,
        "dedupe_key": None,
        "attempts": 0,
        "token": None,
        "started": False,
        "waiting": False,
        "blocked": False,
        "parked": False,
        "cancelled": False,
        "done": False,
        "maybe_applied": False,
        "claimed": False,
        "unsure": False,
        "due": 0.0,
        "left": -1.0,
        "settled_for": None,
    }
    base.update(kw)
    return Row(rid, family, **base)


SlotKey = tuple[str, str]  # (family, actor)


@dataclass(frozen=True)
class Snapshot:
    rows: dict[int, Row]
    requests: frozenset[int]  # outbox_cancel
    slots: dict[SlotKey, dict[str, float]]  # cap set -> member token -> seconds left
    sentinel: bool
    odd_keys: tuple[str, ...] = ()  # cap keys the model cannot name

    def actor_rows(self, family: str, actor: str) -> list[Row]:
        return [r for r in self.rows.values() if r.family == family and r.actor == actor]


def states_of(r: Row) -> list[str]:
    """Every lifecycle state the row's columns put it in; exactly one is right."""
    found = []
    if r.done:
        found.append("done")
    if r.cancelled:
        found.append("cancelled")
    if r.parked:
        found.append("parked")
    if r.live:
        if r.blocked:
            found.append("blocked")
        if r.waiting:
            found.append("waiting")
        if not r.blocked and not r.waiting and r.left is not None:
            if r.token is not None and r.left > 0:
                found.append("leased")
            elif r.left <= 0:
                found.append("due")
            else:
                found.append("scheduled")
    return found


# -- the invariants, as checks of a snapshot (pure: the unit checks feed them bad states) ------


def check_row_states(snap: Snapshot) -> None:
    for r in snap.rows.values():
        fam = FAMILIES[r.family]
        states = states_of(r)
        assert len(states) == 1, f"row {r.id} is in states {states}: {r}"
        assert r.token is None or (r.claimed and r.live), f"row {r.id}: token without claim {r}"
        assert not r.started or (r.live and (r.token is not None or r.waiting)), (
            f"row {r.id}: started without a claim {r}"
        )
        if r.blocked and r.live:
            assert fam.ordered and r.actor is not None, f"row {r.id} blocked outside a line"
            assert r.due is None and r.token is None and not r.started and not r.waiting, (
                f"row {r.id}: a blocked row must wait at infinity, unclaimed: {r}"
            )
        if r.live and not r.blocked:
            assert r.due is not None, f"row {r.id}: unblocked at infinity {r}"
        if r.waiting and r.live:
            assert fam.per_actor is not None and r.token is None, f"row {r.id}: waiting {r}"
        assert r.attempts >= 0
        assert fam.max_attempts is None or r.attempts <= fam.max_attempts, (
            f"row {r.id}: {r.attempts} attempts, max {fam.max_attempts}"
        )
    tokens = [r.token for r in snap.rows.values() if r.token is not None]
    assert len(tokens) == len(set(tokens)), "two rows share a claim token"


def check_caps(snap: Snapshot, unreleased: frozenset[str] | set[str] = frozenset()) -> None:
    """No actor has more live holders than its cap, in Postgres or in Redis, and every live
    slot belongs to a row that holds a live lease under that token, or that started under it
    and whose lease ran out since (its worker died or stalled: a start leaves a young claim's
    slot to run to the claim's lease, and the family's next claim gives it back, which
    ``_claim`` checks), or is counted but not explained (``unreleased``: a returned
    handler's release held unwritten in the batch in progress, or one a killed worker held;
    or the slot of a start a Postgres crash lost, which the model checks itself)."""
    assert not snap.odd_keys, f"cap keys the families do not explain: {snap.odd_keys}"
    for name, fam in FAMILIES.items():
        if fam.per_actor is None:
            continue
        live = Counter(
            r.actor
            for r in snap.rows.values()
            if r.family == name
            and r.actor is not None
            and r.token is not None
            and r.left is not None
            and r.left > TOL
        )
        for actor, n in live.items():
            assert n <= fam.per_actor, (
                f"{name}/{actor}: {n} rows hold live leases, cap {fam.per_actor}"
            )
    by_token = {str(r.token): r for r in snap.rows.values() if r.token is not None}
    for (family, actor), members in snap.slots.items():
        cap = FAMILIES[family].per_actor
        assert cap is not None, f"a cap set for uncapped family {family}"
        holding = [t for t, left in members.items() if left > TOL]
        assert len(holding) <= cap, f"Redis: {family}/{actor} has {len(holding)} live slots"
        for t in holding:
            if t in unreleased:  # a held release: counted, not explained
                continue
            r = by_token.get(t)
            assert r is not None and r.family == family and r.actor == actor, (
                f"Redis: live slot {t} of {family}/{actor} belongs to no row holding it"
            )
            assert r.left is not None and (r.left > 0 or r.started), (
                f"Redis: live slot {t} of {family}/{actor}, but row {r.id}'s lease ran out"
            )


def heads_of(snap: Snapshot, family: str, actor: str) -> tuple[list[Row], list[Row]]:
    fam = FAMILIES[family]
    rows = snap.actor_rows(family, actor)
    heads = [r for r in rows if not r.blocked and (r.live or (r.parked and fam.parked_blocks))]
    return heads, [r for r in rows if r.blocked and r.live]


def check_heads(snap: Snapshot, rejoined: frozenset[int] = frozenset()) -> None:
    """One head per ordered actor, lower than every row waiting behind it, and no actor
    whose rows wait behind nobody. (``rejoined``: parked rows of a line that let them pass,
    retried: they get back in line behind the head that passed them.)"""
    for family in ORDERED:
        for actor in {r.actor for r in snap.rows.values() if r.family == family}:
            assert actor is not None, f"{family}: a row without an actor"
            heads, blocked = heads_of(snap, family, actor)
            assert len(heads) <= 1, f"{family}/{actor} has two heads: {[h.id for h in heads]}"
            if blocked:
                assert heads, f"{family}/{actor}: rows {[b.id for b in blocked]} wait, no head"
                behind = [b.id for b in blocked if b.id not in rejoined]
                assert not behind or heads[0].id < min(behind), (
                    f"{family}/{actor}: head {heads[0].id} is behind {[b.id for b in blocked]}"
                )


def check_tokens(snap: Snapshot, stale: set[tuple[int, UUID]]) -> None:
    """A token the model saw superseded or settled never holds again."""
    for rid, token in stale:
        r = snap.rows.get(rid)
        assert r is None or r.token != token, f"row {rid} holds stale token {token} again"


def check_cancels(snap: Snapshot, requested: set[int], pruned: set[int]) -> None:
    """A cancel request is kept until the row settles as cancelled (or is parked): the row is
    never delivered past it."""
    for rid in requested:
        r = snap.rows.get(rid)
        if r is None and rid in pruned:
            continue  # cancelled, then pruned past its retention
        assert r is not None, f"row {rid} was deleted (delivered) although its cancel was asked"
        assert not r.done, f"row {rid} settled as done although its cancel was asked"
        if r.live:
            assert rid in snap.requests, f"row {rid}'s cancel request vanished; the row is live"
    phantom = snap.requests - requested
    assert not phantom, f"cancel requests nobody asked for: {sorted(phantom)}"


def check_delivered(snap: Snapshot, known: set[int], delivered: set[int], pruned: set[int]) -> None:
    """A row is deleted or done only by a DELIVERED result whose handler returned (or pruned,
    settled, past its retention)."""
    for rid in known:
        r = snap.rows.get(rid)
        if r is None and rid in pruned:
            continue
        if r is None or r.done:
            assert rid in delivered, f"row {rid} is {'done' if r else 'gone'}, never delivered"


def check_start(
    snap: Snapshot,
    rid: int,
    attempt: int,
    prior: int | None,
    rejoined: frozenset[int] = frozenset(),
) -> None:
    """What must hold when an attempt starts: the attempt count only grows, within the
    family's max; an ordered row runs only when every lower row of its actor has left the
    line (but a retried parked row that was passed); a capped actor has at most its cap of
    started, live attempts."""
    r = snap.rows[rid]
    fam = FAMILIES[r.family]
    assert prior is None or attempt > prior, f"row {rid}: attempt {attempt} after {prior}"
    assert fam.max_attempts is None or attempt <= fam.max_attempts, (
        f"row {rid}: attempt {attempt}, max {fam.max_attempts}"
    )
    if fam.ordered and r.actor is not None:
        ahead = [
            o.id
            for o in snap.actor_rows(r.family, r.actor)
            if o.id < rid and (o.live or (o.parked and fam.parked_blocks)) and o.id not in rejoined
        ]
        assert not ahead, f"{r.family}/{r.actor}: row {rid} started before rows {ahead}"
    if fam.per_actor is not None and r.actor is not None:
        running = [
            o.id
            for o in snap.actor_rows(r.family, r.actor)
            if o.started and o.token is not None and o.left is not None and o.left > TOL
        ]
        assert len(running) <= fam.per_actor, (
            f"{r.family}/{r.actor}: rows {running} run at once, cap {fam.per_actor}"
        )


def live_claims(snap: Snapshot, family: str, above: float) -> list[int]:
    """The family's rows whose claim's lease has more than ``above`` seconds left."""
    return [
        r.id
        for r in snap.rows.values()
        if r.family == family and r.token is not None and r.left is not None and r.left > above
    ]


def check_in_flight(snap: Snapshot) -> None:
    """No family has more live claims than its max_in_flight (a lease ending within AMBIG
    may have been read as ended by the claim that took the next row)."""
    for name, fam in FAMILIES.items():
        live = live_claims(snap, name, AMBIG)
        assert len(live) <= fam.max_in_flight, (
            f"{name}: rows {live} are in flight, max_in_flight {fam.max_in_flight}"
        )


def run_checks(
    snap: Snapshot,
    *,
    stale: set[tuple[int, UUID]],
    requested: set[int],
    known: set[int],
    delivered: set[int],
    pruned: set[int],
    rejoined: frozenset[int] = frozenset(),
    unreleased: set[str] | None = None,
) -> None:
    check_row_states(snap)
    check_caps(snap, unreleased or frozenset())
    check_heads(snap, rejoined)
    check_tokens(snap, stale)
    check_cancels(snap, requested, pruned)
    check_delivered(snap, known, delivered, pruned)
    check_in_flight(snap)
