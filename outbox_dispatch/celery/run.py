"""The worker's side of a Celery task call that went through the outbox: its row runs the
task's own function inside a request like Celery's, and what the task does with Celery's
retry, ignore and reject becomes the row's settle."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from outbox_dispatch.celery.task_options import decode_call, retry_delay
from outbox_dispatch.celery.tasks import OutboxTask
from outbox_dispatch.core.errors import PermanentFailure, RetryLater
from outbox_dispatch.core.handlers import Context
from outbox_dispatch.core.logs import event

log = logging.getLogger(__name__)


def run_task(task: Any, queue_of: Callable[[str], str], ctx: Context, payload: Any) -> None:
    """A row of a task call: the task's own function with its args and kwargs, inside a
    request like Celery's (``self.request.id`` the call's id, ``retries`` the attempts
    before this one, ``outbox`` the delivery's Context, ``delivery_info`` the family's queue,
    from ``queue_of``). The request is marked eager so
    that ``self.retry()`` raises its Retry rather than publishing a message: the row is
    retried instead, after the delay the Retry asked for."""
    try:
        call = decode_call(payload)
    except ValueError as exc:
        raise PermanentFailure(f"row {ctx.row_id} is not a call of {task.name}: {exc}") from exc
    now = datetime.now(UTC)
    if call.expires is not None and now >= call.expires:
        event(
            log,
            logging.WARNING,
            "task_expired",
            f"{task.name} expired at {call.expires.isoformat()} before it ran: not run",
            row_id=ctx.row_id,
            family=ctx.family,
            command=ctx.command,
            attempt=ctx.attempt,
        )
        return
    call_id = call.task_id or f"outbox:{ctx.row_id}"  # what the call returned as .id
    flags: dict[str, Any] = {}  # what self.retry() left: shared by the requests pushed on ours
    task.push_request(
        id=call_id,
        root_id=call_id,
        retries=ctx.attempt - 1,
        args=call.args,
        kwargs=call.kwargs,
        is_eager=True,
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": queue_of(ctx.family)},
        outbox=ctx,
        outbox_flags=flags,
        outbox_depth=0,  # the call's own request, pushed by Task.__call__, is depth 1
    )
    try:
        if isinstance(task, OutboxTask):
            task(*call.args, **call.kwargs)  # Celery's own call: current_task is the task
        else:
            task.run(*call.args, **call.kwargs)
        kept = flags.get("retry")  # self.retry(throw=False)
        if isinstance(kept, Retry):
            raise kept
    except Retry as retry:
        raise _retry_later(task, retry, call.args, call.kwargs, now) from retry
    except Ignore:
        return  # Celery records nothing for an ignored task: the row is settled as done
    except Reject as reject:
        if reject.requeue:
            raise RetryLater(
                0.0, f"{task.name} rejected the call and asked to requeue it"
            ) from None
        raise PermanentFailure(f"{task.name} rejected the call: {reject.reason!r}") from reject
    except (PermanentFailure, RetryLater):
        raise
    except Exception as exc:
        if ctx.is_cancelled or type(exc).__name__ == "SoftTimeLimitExceeded":
            raise  # told to stop (time limit, cancel, lost claim): the delivery decides
        # Celery marks such a call FAILURE and does not run it again; its row is parked, to
        # be retried or purged by hand, rather than lost
        if flags.get("retries_out"):
            why = f"its max_retries ({task.max_retries}) ran out"
        else:
            why = (
                "not retried: the task did not call self.retry and autoretry_for does not cover it"
            )
        raise PermanentFailure(f"{type(exc).__name__}: {exc} ({why})") from exc
    finally:
        task.pop_request()


def _retry_later(
    task: Any, retry: Retry, args: list[Any], kwargs: dict[str, Any], now: datetime
) -> Exception:
    """The row's retry for a Celery Retry (``self.retry()`` or ``autoretry_for``), whose
    max_retries check has passed: the next attempt is the retry it counted."""
    sig = getattr(retry, "sig", None)
    if sig is not None and (list(sig.args) != list(args) or dict(sig.kwargs) != dict(kwargs)):
        return PermanentFailure(
            f"{task.name} called self.retry() with new args or kwargs, which a row cannot "
            "take: call the task anew with them instead"
        )
    delay = retry_delay(retry.when, task.default_retry_delay, now, task.app.timezone)
    cause = retry.exc if isinstance(retry.exc, BaseException) else None
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else "self.retry()"
    most = "" if task.max_retries is None else f" of {task.max_retries}"
    return RetryLater(delay, f"{reason} (retry {int(task.request.retries) + 1}{most})")
