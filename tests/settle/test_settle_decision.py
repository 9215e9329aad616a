"""The pure decisions of settle.py and policy.cap_rule: which settle an attempt's ending
gets, what an applied settle means, and which rows are capped (hypothesis over the inputs)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.core.policy import Backoff, CapRule, Family, cap_rule, family_is_capped
from outbox_dispatch.core.settle import (
    QUERY,
    Outcome,
    SettleKind,
    StopReason,
    after_failure,
    after_return,
    delivered,
    leaves_line,
    outcome,
    stop_error,
)
from outbox_dispatch.store.sqlfiles import raw_queries

families = st.builds(
    Family,
    name=st.just("fam"),
    max_attempts=st.one_of(st.none(), st.integers(1, 10)),
    backoff=st.just(Backoff(1.0, 60.0, 0.2)),
    retention=st.sampled_from([0.0, 60.0]),
    time_limit=st.one_of(st.none(), st.floats(0.5, 100)),
)
stops = st.one_of(st.none(), st.sampled_from(list(StopReason)))


@given(families, st.integers(1, 12), st.floats(0, 1, exclude_max=True), stops)
def test_a_return_is_delivered_only_when_the_handler_was_not_told_to_stop(
    family: Family, attempts: int, rand: float, stop: StopReason | None
) -> None:
    settle = after_return(family, attempts, rand, stop)
    if stop is None or stop is StopReason.CANCEL_REQUESTED:
        assert settle == delivered(family)
        assert settle.kind is (SettleKind.DONE if family.retention > 0 else SettleKind.DELETE)
    else:  # invariant 12: retried or parked, never delivered
        assert settle.kind in (SettleKind.RETRY, SettleKind.PARK)
        assert (settle.error and stop.value in settle.error) or "time_limit" in (settle.error or "")
        if settle.kind is SettleKind.RETRY:
            assert settle.maybe_applied  # its effects are unknown


@given(families, st.integers(1, 12), st.floats(0, 1, exclude_max=True))
def test_a_failure_parks_exactly_when_attempts_ran_out(
    family: Family, attempts: int, rand: float
) -> None:
    settle = after_failure(family, attempts, rand, "boom")
    out_of_attempts = family.max_attempts is not None and attempts >= family.max_attempts
    assert (settle.kind is SettleKind.PARK) is out_of_attempts
    if settle.kind is SettleKind.RETRY:
        assert 0 < settle.delay <= family.backoff.cap
    assert settle.error == "boom" and not settle.maybe_applied


def test_a_time_limit_names_the_limit_and_says_what_to_do() -> None:
    fam = Family("f", time_limit=2.5)
    assert "time_limit of 2.5 s" in stop_error(fam, None, StopReason.TIME_LIMIT)
    assert "raise time_limit" in stop_error(fam, "SoftTimeLimitExceeded()", StopReason.TIME_LIMIT)
    raised = stop_error(fam, "ValueError: x", StopReason.SLOT_LAPSED)
    assert raised.startswith("ValueError: x") and "cap slot lapsed" in raised
    assert stop_error(fam, "ValueError: x", StopReason.CANCEL_REQUESTED) == "ValueError: x"
    assert stop_error(fam, "ValueError: x", None) == "ValueError: x"


def test_an_applied_settle_means_what_was_asked_a_cancel_or_a_lost_claim() -> None:
    assert outcome(None) is Outcome.LOST  # the token no longer held
    assert outcome(SettleKind.CANCEL) is Outcome.CANCELLED
    assert outcome(SettleKind.DELETE) is outcome(SettleKind.DONE) is Outcome.DELIVERED
    assert outcome(SettleKind.RETRY) is Outcome.RETRIED
    assert outcome(SettleKind.PARK) is Outcome.PARKED


def test_every_settle_kind_names_a_query_in_settle_sql() -> None:
    assert set(QUERY) == set(SettleKind)
    assert set(QUERY.values()) <= set(raw_queries())


@given(st.one_of(st.none(), st.sampled_from(list(SettleKind))), st.booleans())
def test_an_ordered_head_leaves_its_line_when_settled_for_good(
    applied: SettleKind | None, parked_blocks: bool
) -> None:
    expected = applied in (SettleKind.DELETE, SettleKind.DONE, SettleKind.CANCEL) or (
        applied is SettleKind.PARK and not parked_blocks
    )
    assert leaves_line(applied, parked_blocks) is expected


@given(
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(1, 5)),
    st.booleans(),
    st.one_of(st.none(), st.sampled_from(["a", "b"])),
)
def test_the_cap_rule(
    family_cap: int | None, command_cap: int | None, ordered: bool, actor: str | None
) -> None:
    fam = Family("f", per_actor=None if ordered else family_cap, ordered=ordered)
    rule = cap_rule(fam, "cmd", command_cap, actor)
    if actor is None or ordered:
        assert rule is None  # no actor, or ordered: no slot
    elif command_cap is not None:
        assert rule == CapRule("cmd", command_cap)  # a command's own cap, its own semaphore
    elif fam.per_actor is not None:
        assert rule == CapRule("", fam.per_actor)
    else:
        assert rule is None
    assert family_is_capped(fam, command_cap is not None) is (
        not ordered and (fam.per_actor is not None or command_cap is not None)
    )
