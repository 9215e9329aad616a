"""Heartbeats in one process: a long handler's lease is renewed, so that no other claim takes
its row, and ``ctx.heartbeat`` records progress (a value jsonb cannot hold is refused at the
call, and the lease still renews)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from outbox_dispatch import Context, Dispatcher, InvalidPayload, Outcome
from tests.support.lifecycle import (
    _name,
    _one,
    _row,
    life_dispatcher,  # noqa: F401 (the fixture life)
)

pytestmark = pytest.mark.usefixtures("clean")


def _deliver_while_a_rival_claims(life: Dispatcher, row_id: int) -> list[int]:
    """Deliver ``row_id`` (family ``short``) while another claimer tries every 0.1 s to take
    the family's rows, which it gets only if their lease lapsed; the rows it took."""
    stolen: list[int] = []
    stop = threading.Event()

    def rival() -> None:
        while not stop.is_set():
            stolen.extend(c.id for c in life.claimer.claim_family(life.families["short"]).claimed)
            time.sleep(0.1)

    result = life.claimer.claim_family(life.families["short"])
    t = threading.Thread(target=rival)
    t.start()
    try:
        assert life.delivery.deliver(row_id, result.claimed[0].token).outcome is Outcome.DELIVERED
    finally:
        stop.set()
        t.join()
    return stolen


def test_heartbeat_keeps_a_long_handler_from_being_claimed_again(
    life: Dispatcher, database_url: str
) -> None:
    runs: list[int] = []
    cmd = _name()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: renewed every 0.33 s
    def slow(ctx: Context, payload: Any) -> None:
        runs.append(ctx.attempt)
        time.sleep(2.5)

    row_id = _one(life, database_url, cmd)
    assert _deliver_while_a_rival_claims(life, row_id) == []
    assert runs == [1]


def test_progress_is_recorded_by_ctx_heartbeat(life: Dispatcher, database_url: str) -> None:
    cmd = _name()
    seen: list[Any] = []

    @life.handler(cmd, family="kept")
    def report(ctx: Context, payload: Any) -> None:
        assert ctx.heartbeat({"done": 5, "of": 10})
        seen.append(_row(database_url, life.schema, ctx.row_id)["progress"])

    _one(life, database_url, cmd)
    life.drain(timeout=5)
    assert seen == [{"done": 5, "of": 10}]


def test_progress_that_is_not_json_is_refused_at_the_call_and_the_lease_still_renews(
    life: Dispatcher, database_url: str
) -> None:
    """A handler passes ctx.heartbeat a progress value jsonb cannot hold (an object, NaN).
    The call raises InvalidPayload saying so, the row's progress is left as it was, and the
    lease goes on being renewed: the value once stayed on the heartbeat's entry and every
    later renewal failed on it (an object ended the heartbeat thread; NaN failed in
    Postgres, tick after tick), and the row was claimed again while its handler still ran."""
    runs: list[int] = []
    errors: list[str] = []
    seen: list[Any] = []
    cmd = _name()

    @life.handler(cmd, family="short")  # heartbeat timeout 1 s: renewed every 0.33 s
    def slow(ctx: Context, payload: Any) -> None:
        runs.append(ctx.attempt)
        progress: dict[str, Any] = {"done": 1}
        assert ctx.heartbeat(progress)
        progress["rate"] = math.nan  # changed after the call: the renewals send what it was
        for bad in ({"at": object()}, {"rate": math.nan}):
            with pytest.raises(InvalidPayload) as raised:
                ctx.heartbeat(bad)
            errors.append(str(raised.value))
        seen.append(_row(database_url, life.schema, ctx.row_id)["progress"])
        time.sleep(2.5)

    row_id = _one(life, database_url, cmd)
    assert _deliver_while_a_rival_claims(life, row_id) == []
    assert runs == [1]
    assert len(errors) == 2, errors
    assert all("heartbeat progress" in e and "JSON" in e for e in errors), errors
    assert seen == [{"done": 1}]
