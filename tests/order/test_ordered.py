"""Ordered families in one process: one row per actor at a time, in enqueue order (a failed row
retried before the next), and a parked head that blocks its actor's line until it is retried
or purged, or lets later rows pass when the family says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from outbox_dispatch import Context, Dispatcher, Message
from tests.conftest import count_rows
from tests.support.capped import (
    _enqueue,
    capped_fixture,  # noqa: F401 (the fixture capped)
    caps_url_fixture,  # noqa: F401 (the fixture caps_url)
    record_fixture,  # noqa: F401 (the fixture record)
)

pytestmark = pytest.mark.usefixtures("clean")


def test_ordered_family_runs_one_row_per_actor_in_enqueue_order(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    fail_once = {"x": True}

    def maybe_fail(ctx: Context, payload: Any) -> None:
        if payload["n"] == 1 and fail_once["x"]:
            fail_once["x"] = False
            raise RuntimeError("first try of row 1 fails")

    cmd = record("lined", maybe_fail)
    from datetime import timedelta

    msgs = [Message(cmd, {"n": n}, actor="O") for n in range(5)]
    msgs[0] = Message(cmd, {"n": 0}, actor="O", delay=timedelta(milliseconds=200))  # delayed head
    msgs.append(Message(cmd, {"n": 0}, actor="P"))
    _enqueue(capped, database_url, msgs)
    fam = capped.families["lined"]
    result = capped.claimer.claim_family(fam)
    assert [c.actor for c in result.claimed] == ["P"]  # O's head is delayed: O waits for it
    status = {s.family: s for s in capped.ops.status()}["lined"]
    assert status.blocked == 4

    import time

    time.sleep(0.25)
    for c in result.claimed:
        capped.delivery.deliver(c.id, c.token)
    deadline = time.monotonic() + 10
    while count_rows(database_url, capped.schema, "family = 'lined' AND parked_at IS NULL") > 0:
        step = capped.claimer.claim_family(fam)
        assert len([c for c in step.claimed if c.actor == "O"]) <= 1, "two rows of O at once"
        for c in step.claimed:
            capped.delivery.deliver(c.id, c.token)
        time.sleep(0.02)
        assert time.monotonic() < deadline
    seen = [p["n"] for a, p in record.seen if a == "O"]  # type: ignore[attr-defined]
    assert seen == [0, 1, 1, 2, 3, 4]  # row 1 failed once and was retried before row 2


def test_parked_head_blocks_its_actor_until_retried_or_purged(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    broken = {"on": True}

    def fail(ctx: Context, payload: Any) -> None:
        if broken["on"] and payload["n"] == 0:
            raise RuntimeError("head fails")

    cmd = record("lined", fail)  # lined: max_attempts=2, parked rows block
    ids = _enqueue(capped, database_url, [Message(cmd, {"n": n}, actor="Q") for n in range(3)])
    import time

    for _ in range(3):
        capped.drain(timeout=5)
        time.sleep(0.03)
    assert count_rows(database_url, capped.schema, f"id = {ids[0]} AND parked_at IS NOT NULL") == 1
    assert count_rows(database_url, capped.schema, f"id > {ids[0]} AND blocked") == 2
    broken["on"] = False
    assert capped.ops.parked_retry(ids=[ids[0]]) == [ids[0]]
    capped.drain(timeout=5)
    assert [p["n"] for a, p in record.seen if a == "Q"][-3:] == [0, 1, 2]  # type: ignore[attr-defined]


def test_parked_head_lets_later_rows_pass_when_the_family_says_so(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    def fail(ctx: Context, payload: Any) -> None:
        if payload["n"] == 0:
            raise RuntimeError("head fails")

    cmd = record("passing", fail)  # max_attempts=1, parked_blocks=False
    ids = _enqueue(capped, database_url, [Message(cmd, {"n": n}, actor="S") for n in range(3)])
    capped.drain(timeout=5)
    assert [p["n"] for a, p in record.seen if a == "S"] == [0, 1, 2]  # type: ignore[attr-defined]
    assert count_rows(database_url, capped.schema, f"id = {ids[0]} AND parked_at IS NOT NULL") == 1


def test_retrying_two_parked_rows_of_a_passing_line_keeps_it_moving(
    capped: Dispatcher, record: Callable[..., str], database_url: str
) -> None:
    broken = {"on": True}

    def fail(ctx: Context, payload: Any) -> None:
        if broken["on"] and payload["n"] < 2:
            raise RuntimeError("fails while broken")

    cmd = record("passing", fail)  # max_attempts=1, parked_blocks=False
    ids = _enqueue(capped, database_url, [Message(cmd, {"n": n}, actor="T") for n in range(3)])
    capped.drain(timeout=5)
    assert (
        count_rows(database_url, capped.schema, f"id = ANY(ARRAY{ids}) AND parked_at IS NOT NULL")
        == 2
    )
    broken["on"] = False
    assert capped.ops.parked_retry(ids=ids[:2]) == ids[:2]
    capped.drain(timeout=5)
    assert count_rows(database_url, capped.schema, f"id = ANY(ARRAY{ids})") == 0
    assert [p["n"] for a, p in record.seen if a == "T"][-2:] == [0, 1]  # type: ignore[attr-defined]
