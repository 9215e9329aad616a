"""The pure decision of which rows a capped claim takes (property-based)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.core.policy import Candidate, CapRule, plan_capped_claim

ACTORS = [None, "a", "b", "c", "d", "big"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Candidate], dict[str, int], int]:
    """Candidates as the SQL returns them: ranked per actor, ordered by (rank, due)."""
    n = draw(st.integers(0, 60))
    actors = [draw(st.sampled_from(ACTORS)) for _ in range(n)]
    commands = [draw(st.sampled_from(["x", "y"])) for _ in range(n)]
    seen: Counter[str | None] = Counter()
    rows = []
    for i, (actor, command) in enumerate(zip(actors, commands, strict=True)):
        seen[actor] += 1
        rank = 1 if actor is None else seen[actor]
        rows.append((rank, i, Candidate(i + 1, actor, command, rank)))
    rows.sort(key=lambda r: (r[0], r[1]))
    caps = {"x": draw(st.integers(1, 4)), "y": draw(st.integers(1, 4))}
    return [c for _, _, c in rows], caps, draw(st.integers(0, 30))


@given(scenarios())
def test_plan_respects_limit_and_caps(s: tuple[list[Candidate], dict[str, int], int]) -> None:
    candidates, caps, limit = s
    plan = plan_capped_claim(
        candidates,
        lambda c: None if c.actor is None else CapRule(c.command, caps[c.command]),
        limit,
    )
    assert len(plan.take) <= limit
    ids = [c.id for c in plan.take] + [c.id for c in plan.wait]
    assert len(ids) == len(set(ids)), "a row is both taken and waiting"
    per_slot: Counter[tuple[str, str]] = Counter()  # each command's cap is its own semaphore
    for c in plan.take:
        if c.actor is not None:
            per_slot[(c.actor, c.command)] += 1
            # counting in take order, no row is taken beyond its own cap
            assert per_slot[(c.actor, c.command)] <= caps[c.command]
    for c in plan.wait:
        assert c.actor is not None
        # a row waits only when its actor already got as many rows as this row's cap allows,
        # counting only the rows of the same cap (another command's slots never hold it back)
        taken_before = [
            t for t in plan.take if (t.actor, t.command) == (c.actor, c.command) and t.id != c.id
        ]
        assert len(taken_before) >= caps[c.command]


@given(scenarios())
def test_plan_is_fair_in_rank_order(s: tuple[list[Candidate], dict[str, int], int]) -> None:
    """Every taken row comes before every row left due: no actor's later rank is taken while an
    earlier rank of another actor that was under its cap is passed over."""
    candidates, caps, limit = s
    plan = plan_capped_claim(
        candidates,
        lambda c: None if c.actor is None else CapRule(c.command, caps[c.command]),
        limit,
    )
    position = {c.id: i for i, c in enumerate(candidates)}
    decided = {c.id for c in plan.take} | {c.id for c in plan.wait}
    left = [c for c in candidates if c.id not in decided]
    if plan.take and left:
        assert max(position[c.id] for c in plan.take) < min(position[c.id] for c in left)
    if left:
        assert len(plan.take) == limit  # rows stay due only when the claim is full


def test_big_backlog_does_not_crowd_out_small_actors() -> None:
    big = [Candidate(i, "big", "x", i) for i in range(1, 1001)]
    small = [Candidate(2000 + i, f"s{i}", "x", 1) for i in range(20)]
    ranked = sorted(big + small, key=lambda c: c.rank)
    plan = plan_capped_claim(ranked, lambda c: CapRule("", 1), limit=50)
    assert {c.actor for c in plan.take} == {"big"} | {f"s{i}" for i in range(20)}
    assert len(plan.wait) == 999  # the rest of the big backlog leaves the due range
