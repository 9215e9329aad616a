"""Delivery of a claimed row: stale and forged messages run nothing and settle nothing, a
redelivered message of a started attempt waits for the lease, and a claim that never started
costs no attempt."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Dispatcher, Outcome
from tests.fixtures.inprocess import Effects
from tests.support.delivery import _claim_one, _enqueue, _row

pytestmark = pytest.mark.usefixtures("clean")


def test_stale_and_forged_messages_run_nothing_and_settle_nothing(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    cmd = commands()
    row_id = _enqueue(dispatcher, database_url, cmd)
    _, old_token = _claim_one(dispatcher)
    # the lease runs out and the row is claimed again under a new token
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"UPDATE \"{dispatcher.schema}\".outbox SET due_at = now() - interval '1s'")
    _, new_token = _claim_one(dispatcher)
    before = _row(database_url, dispatcher.schema, row_id)

    garbage: list[tuple[Any, ...]] = [
        (row_id, str(old_token)),  # old token
        (row_id, str(uuid.uuid4())),  # forged token
        (row_id + 10_000, str(new_token)),  # unknown id
        (row_id,),
        ("x", "y"),
        (row_id, "not-a-uuid"),
        (True, str(new_token)),
        (-1, str(new_token)),
        ({"id": row_id}, None),
        (),
        ([[row_id, str(old_token)]],),  # a batch naming the old claim
        ([[row_id, str(new_token)], "junk"],),  # a batch with garbage in it
        ([],),
    ]
    for args in garbage:
        results = dispatcher.delivery.deliver_message(args)
        assert [r.outcome for r in results] == [Outcome.STALE], args
    assert effects.rows(cmd) == []
    assert _row(database_url, dispatcher.schema, row_id) == before

    # the current claim still works
    assert dispatcher.delivery.deliver(row_id, new_token).outcome is Outcome.DELIVERED
    assert effects.rows(cmd) == [row_id]
    # and replaying it afterwards is stale
    assert dispatcher.delivery.deliver(row_id, new_token).outcome is Outcome.STALE
    assert effects.rows(cmd) == [row_id]


def test_redelivered_message_of_a_started_attempt_waits_for_the_lease(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Effects, database_url: str
) -> None:
    """A killed worker's message is requeued at once: it must not run the handler again."""
    cmd = commands()
    row_id = _enqueue(dispatcher, database_url, cmd)
    _, token = _claim_one(dispatcher)
    # the attempt started, then its process died before settling
    assert dispatcher.store.begin(row_id, token, run_lease=30) is not None
    assert dispatcher.delivery.deliver(row_id, token).outcome is Outcome.STALE
    assert effects.rows(cmd) == []
    # after the lease the row is claimed again, flagged as maybe applied
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'UPDATE "{dispatcher.schema}".outbox SET due_at = now()')
    report = dispatcher.drain(timeout=5)
    assert report.delivered == 1
    seen = [attempt for c, _, attempt, _ in effects.calls if c == cmd]
    assert seen == [2]  # the handler ran once, as the second attempt


def test_claim_that_never_started_costs_no_attempt(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    """A message lost between claim and start (claimer died before publishing)."""
    cmd = commands(family="quick")
    row_id = _enqueue(dispatcher, database_url, cmd)
    for _ in range(5):
        _claim_one(dispatcher, "quick")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'UPDATE "{dispatcher.schema}".outbox SET due_at = now()')
    row = _row(database_url, dispatcher.schema, row_id)
    assert row["attempts"] == 1 and row["maybe_applied"] is False and row["parked_at"] is None
    assert dispatcher.drain(timeout=5).delivered == 1
