"""What a delivery message reports to Celery, and so to Flower, pure: the rows' outcome, not
"the task function returned". Delivered is SUCCESS with a short result; an attempt that will
run again is RETRY with its error and when; a parked row is FAILURE with its error; a
cancelled row is REVOKED; a message whose claim no longer holds is STALE. The message is acked
and the row settled by us in every case: no Celery retry message is ever published.

A batched message is SUCCESS, its result each row's outcome. wiring.py turns the state into
what Celery understands (a return value, or an event of ours with the handler's error and
traceback, then Ignore).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.worker.messages import Result


class Report(StrEnum):
    SUCCESS = "SUCCESS"
    RETRY = "RETRY"
    FAILURE = "FAILURE"
    REVOKED = "REVOKED"
    STALE = "STALE"  # a state of our own: Flower shows it by name


@dataclass(frozen=True)
class TaskState:
    report: Report
    text: str  # the SUCCESS result, else the error or the reason shown with the state
    due_in: float | None = None  # RETRY: seconds until the row is due again
    traceback: str = ""  # RETRY, FAILURE: the handler's traceback


def task_state(results: Sequence[Result]) -> TaskState:
    """The Celery state of a delivery message, from the results of its rows."""
    if len(results) != 1:
        by: dict[str, list[int]] = {}
        for r in results:
            by.setdefault(r.outcome.value, []).append(r.row_id or 0)
        return TaskState(Report.SUCCESS, "; ".join(f"{k} {v}" for k, v in sorted(by.items())))
    r = results[0]
    match r.outcome:
        case Outcome.DELIVERED:
            return TaskState(Report.SUCCESS, "delivered")
        case Outcome.RETRIED:
            return TaskState(Report.RETRY, r.detail, r.due_in, r.traceback)
        case Outcome.PARKED:
            return TaskState(Report.FAILURE, r.detail, None, r.traceback)
        case Outcome.CANCELLED:
            return TaskState(Report.REVOKED, "cancelled")
        case _:  # stale, or lost: the attempt's result was discarded
            return TaskState(Report.STALE, f"{r.outcome.value}: {r.detail}".rstrip(": "))
