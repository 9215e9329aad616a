"""The model's invariants (invariants.py) accept a good state and fire on bad ones, pure."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest

from tests.model.invariants import (
    CAPPED,
    LINED,
    PASSING,
    PLAIN,
    Row,
    Snapshot,
    check_cancels,
    check_caps,
    check_delivered,
    check_heads,
    check_row_states,
    check_start,
    check_tokens,
    row,
    run_checks,
)

# -- the invariants fire on bad states ------------------------------------------------------

T1, T2 = uuid.UUID(int=1), uuid.UUID(int=2)


def _snap(*rows: Row, **kw: Any) -> Snapshot:
    base: dict[str, Any] = {"requests": frozenset(), "slots": {}, "sentinel": True}
    base.update(kw)
    return Snapshot({r.id: r for r in rows}, **base)


def _fires(check: Any, *args: Any) -> None:
    with pytest.raises(AssertionError):
        check(*args)


def test_invariants_accept_a_good_state() -> None:
    good = _snap(
        row(1, token=T1, claimed=True, left=4.0, due=4.0),
        row(2, CAPPED, actor="a", token=T2, claimed=True, started=True, left=2.0),
        row(3, CAPPED, actor="a", waiting=True, left=3.0),
        row(4, LINED, actor="a", parked=True),
        row(5, LINED, actor="a", blocked=True, due=None, left=None),
        row(6, PASSING, actor="a", parked=True),
        row(7, PASSING, actor="a"),
        row(8, CAPPED, done=True),
        requests=frozenset({2}),
        slots={(CAPPED, "a"): {str(T2): 2.0, "old": -3.0}},
    )
    run_checks(
        good,
        stale={(1, T2)},
        requested={2, 10},
        known={1, 2, 8, 9, 10},
        delivered={8, 9},
        pruned={10},
    )


def test_invariants_fire_on_bad_states() -> None:
    # a row in two states at once, or in none that fits its family
    _fires(check_row_states, _snap(row(1, parked=True, done=True)))
    _fires(check_row_states, _snap(row(1, LINED, actor="a", blocked=True, waiting=True)))
    _fires(check_row_states, _snap(row(1, PLAIN, waiting=True, left=3.0)))
    _fires(check_row_states, _snap(row(1, LINED, actor="a", blocked=True, left=-1.0)))
    _fires(check_row_states, _snap(row(1, started=True)))
    _fires(check_row_states, _snap(row(1, attempts=4)))
    # two live holders of a cap-1 actor, in Postgres or in Redis; a slot nobody holds
    two = [
        row(i, CAPPED, actor="a", token=t, claimed=True, left=2.0) for i, t in ((1, T1), (2, T2))
    ]
    _fires(check_caps, _snap(*two))
    slots = {(CAPPED, "a"): {str(T1): 2.0, str(T2): 2.0}}
    _fires(check_caps, _snap(two[0], slots=slots))
    _fires(check_caps, _snap(slots={(CAPPED, "a"): {str(T1): 2.0}}))
    lapsed = row(1, CAPPED, actor="a", token=T1, claimed=True, left=-0.5)
    _fires(check_caps, _snap(lapsed, slots={(CAPPED, "a"): {str(T1): 2.0}}))
    _fires(check_caps, _snap(odd_keys=("x:cap:{nope}",)))
    # two heads; rows waiting behind nobody; a head behind its followers
    _fires(check_heads, _snap(row(1, LINED, actor="a"), row(2, LINED, actor="a")))
    _fires(check_heads, _snap(row(1, LINED, actor="a", parked=True), row(2, LINED, actor="a")))
    blocked = row(2, PASSING, actor="a", blocked=True, due=None, left=None)
    _fires(check_heads, _snap(row(1, PASSING, actor="a", parked=True), blocked))
    _fires(check_heads, _snap(replace(blocked, id=1), row(2, PASSING, actor="a")))
    # a stale token that holds again
    _fires(check_tokens, _snap(row(1, token=T1, claimed=True, left=3.0)), {(1, T1)})
    # a cancel request lost, a requested row delivered, a request nobody made
    _fires(check_cancels, _snap(row(1)), {1}, set())
    _fires(check_cancels, _snap(), {1}, set())
    _fires(check_cancels, _snap(row(1, CAPPED, done=True)), {1}, set())
    _fires(check_cancels, _snap(row(1), requests=frozenset({1})), set(), set())
    # a row gone, or done, without a delivery whose handler returned
    _fires(check_delivered, _snap(), {1}, set(), set())
    _fires(check_delivered, _snap(row(1, CAPPED, done=True)), {1}, set(), set())
    # an attempt count that does not grow, one past the max, a row run out of its line, two
    # started rows of a cap-1 actor
    _fires(check_start, _snap(row(1, attempts=2)), 1, 2, 2)
    _fires(check_start, _snap(row(1, attempts=4)), 1, 4, None)
    line = _snap(row(1, LINED, actor="a", parked=True), row(2, LINED, actor="a"))
    _fires(check_start, line, 2, 1, None)
    running = [
        row(i, CAPPED, actor="a", token=t, claimed=True, started=True, left=2.0)
        for i, t in ((1, T1), (2, T2))
    ]
    _fires(check_start, _snap(*running), 2, 1, None)
    # and the passing line lets a row run past a parked one
    check_start(
        _snap(row(1, PASSING, actor="a", parked=True), row(2, PASSING, actor="a")), 2, 1, None
    )
