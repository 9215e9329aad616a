"""Property-based tests of the capped pick that test_capped_plan leaves open: per-actor
fairness, every actor served when a claim has room for all, rows past an actor's cap out of
the due range and uncapped rows never waiting."""

from __future__ import annotations

from collections import Counter

from hypothesis import assume, example, given
from hypothesis import strategies as st

from outbox_dispatch.core.policy import Candidate, CapRule, plan_capped_claim

# -- the capped pick ----------------------------------------------------------------------------


@st.composite
def capped_claims(
    draw: st.DrawFn,
) -> tuple[list[Candidate], dict[str, int], int]:
    """Due rows in due order, ranked per actor and sorted (rank, due) as the SQL returns them,
    per-command caps, and the claim's limit."""
    actors = draw(st.lists(st.sampled_from([None, "a", "b", "c", "d", "e", "big"]), max_size=80))
    commands = [draw(st.sampled_from(["x", "y"])) for _ in actors]
    seen: Counter[str | None] = Counter()
    ranked = []
    for i, (actor, command) in enumerate(zip(actors, commands, strict=True)):
        seen[actor] += 1
        rank = 1 if actor is None else seen[actor]
        ranked.append((rank, i, Candidate(i + 1, actor, command, rank)))
    ranked.sort(key=lambda r: (r[0], r[1]))
    caps = {"x": draw(st.integers(1, 5)), "y": draw(st.integers(1, 5))}
    return [c for _, _, c in ranked], caps, draw(st.integers(0, 40))


def _plan(
    case: tuple[list[Candidate], dict[str, int], int],
) -> tuple[list[Candidate], list[Candidate], list[Candidate]]:
    candidates, caps, limit = case
    plan = plan_capped_claim(
        candidates,
        lambda c: None if c.actor is None else CapRule(c.command, caps[c.command]),
        limit,
    )
    decided = {c.id for c in plan.take} | {c.id for c in plan.wait}
    return plan.take, plan.wait, [c for c in candidates if c.id not in decided]


@given(capped_claims())
def test_no_actor_with_rows_left_is_more_than_one_row_behind_another(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    """Max-min fairness: an actor whose rows were left due (not at its cap) got at least as
    many rows as any other actor, less one: a backlog cannot take a small actor's share."""
    take, wait, left = _plan(case)
    taken = Counter(c.actor for c in take if c.actor is not None)
    waiting = {c.actor for c in wait}
    behind = {c.actor for c in left if c.actor is not None} - waiting
    for actor in behind:
        for other, n in taken.items():
            assert n <= taken[actor] + 1, (actor, other, dict(taken))


@given(capped_claims())
def test_a_claim_with_room_for_every_actor_serves_every_actor(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    """No starvation: when the limit covers every actor's first row (and the uncapped rows),
    every actor gets a row, whatever the size of the others' backlogs."""
    candidates, _, limit = case
    firsts = [c for c in candidates if c.rank == 1]
    assume(limit >= len(firsts))
    take, _, _ = _plan(case)
    assert {c.actor for c in take} == {c.actor for c in candidates}
    assert {c.id for c in firsts} <= {c.id for c in take}


@given(capped_claims())
@example(([Candidate(1, "a", "x", 1), Candidate(2, "a", "x", 2)], {"x": 1, "y": 1}, 5))
def test_rows_past_an_actors_cap_leave_the_due_range_and_uncapped_rows_never_wait(
    case: tuple[list[Candidate], dict[str, int], int],
) -> None:
    _, caps, limit = case
    take, wait, left = _plan(case)
    assert all(c.actor is not None for c in wait)
    per_slot = Counter((c.actor, c.command) for c in take)
    for c in wait:  # every waiting row's actor really is at the cap that applies to that row
        assert per_slot[(c.actor, c.command)] >= caps[c.command]
    if len(take) < limit:  # room left: nothing stays due that could have been taken
        assert left == []
