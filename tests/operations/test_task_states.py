"""The Celery state a delivery message reports, pure: each outcome, and a batch."""

from __future__ import annotations

import pytest

from outbox_dispatch.celery.task_states import Report, TaskState, task_state
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.worker.messages import Result


@pytest.mark.parametrize(
    ("result", "state"),
    [
        (Result(Outcome.DELIVERED, 1), TaskState(Report.SUCCESS, "delivered")),
        (
            Result(Outcome.RETRIED, 1, "ConnectionError: down", 2.5),
            TaskState(Report.RETRY, "ConnectionError: down", 2.5),
        ),
        (Result(Outcome.PARKED, 1, "bad address"), TaskState(Report.FAILURE, "bad address")),
        (Result(Outcome.CANCELLED, 1), TaskState(Report.REVOKED, "cancelled")),
        (Result(Outcome.STALE, 1, "row is gone"), TaskState(Report.STALE, "stale: row is gone")),
        (Result(Outcome.LOST, 1, "claim lost"), TaskState(Report.STALE, "lost: claim lost")),
        (Result(Outcome.STALE, None), TaskState(Report.STALE, "stale")),
    ],
)
def test_a_one_row_message_reports_its_rows_outcome(result: Result, state: TaskState) -> None:
    assert task_state([result]) == state


def test_a_batched_message_succeeds_with_each_rows_outcome() -> None:
    results = [
        Result(Outcome.DELIVERED, 1),
        Result(Outcome.RETRIED, 2, "e", 1.0),
        Result(Outcome.DELIVERED, 3),
        Result(Outcome.PARKED, 4, "p"),
    ]
    assert task_state(results) == TaskState(
        Report.SUCCESS, "delivered [1, 3]; parked [4]; retried [2]"
    )
