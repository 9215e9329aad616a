"""Transactional handlers: the handler's writes and its row's settle commit in one transaction,
fenced by the claim token, or not at all (store/deliveries.py's handler_transaction)."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable

from outbox_dispatch.core.errors import DatabaseUnavailable, PermanentFailure
from outbox_dispatch.core.handlers import HandlerFn
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import (
    Outcome,
    Settle,
    SettleKind,
    StopReason,
    after_failure,
    delivered,
    stop_error,
)
from outbox_dispatch.store import Store
from outbox_dispatch.worker.heartbeat import Running
from outbox_dispatch.worker.messages import Result, row_fields
from outbox_dispatch.worker.settling import Settler, after_exception, never_awaited, report

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    """Unwinds a transactional handler's transaction when its row was cancelled."""


class _Stopped(Exception):
    """Unwinds a transactional handler's transaction when it returned after being told to
    stop: its writes are rolled back and the row is retried."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


def run_in_transaction(
    store: Store,
    settler: Settler,
    started: Started,
    family: Family,
    fn: HandlerFn,
    running: Running,
    rand: Callable[[], float],
) -> Result:
    """The handler's writes and the row's settle commit together, fenced by the claim
    token, or not at all: exactly-once effects for work that stays in Postgres."""
    t0 = time.perf_counter()
    ctx = running.ctx
    ran = False
    try:
        with store.handler_transaction(started.id, started.token) as held:
            if held is None:  # the claim no longer holds
                lost = Result(Outcome.LOST, started.id, "the claim no longer holds")
                report(started, lost, delivered(family), 0.0)
                return lost
            conn, cancel = held
            if cancel:
                raise _Cancelled()
            ctx.conn = conn
            ran = True
            returned = fn(ctx, started.payload)
            if inspect.isawaitable(returned):  # rolled back, and parked as below
                raise PermanentFailure(never_awaited(returned))
            reason = running.stop_reason()
            if reason is StopReason.CANCEL_REQUESTED:
                raise _Cancelled()
            if reason is not None:
                raise _Stopped(reason)  # roll the handler's writes back, then retry
            settled = settler.settle(
                delivered(family), started, family, conn=conn, release=False, or_cancel=False
            )
            if not settled:
                raise _Cancelled()  # a cancel request arrived: undo the handler's writes
    except _Cancelled:
        return settler.finish(started, family, Settle(SettleKind.CANCEL))
    except _Stopped as stop:  # rolled back: nothing was applied
        error = stop_error(family, None, stop.reason)
        return settler.finish(
            started, family, after_failure(family, started.attempts, rand(), error)
        )
    except Exception as exc:
        if not ran and isinstance(exc, DatabaseUnavailable):  # no connection for it
            return settler.hand_back_unrun(started, family, exc)
        return settler.finish(started, family, after_exception(started, family, exc, running, rand))
    finally:
        ctx.conn = None
    settler.slots.release(started, family)
    event(
        log,
        logging.INFO,
        "delivered",
        f"transactional handler committed in {(time.perf_counter() - t0) * 1000:.1f} ms",
        **row_fields(started),
    )
    return Result(Outcome.DELIVERED, started.id)
