"""The last step of a delivery: apply the settle decided for an attempt, fenced by the row's
claim token, log what it came to and give the row's cap slot back. The settles decided here:
a row that fails the checks before its handler runs, a handler that raised or returned an
awaitable."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from outbox_dispatch.core.errors import PermanentFailure, RetryLater
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import (
    Outcome,
    Settle,
    SettleKind,
    StopReason,
    after_failure,
    outcome,
    retry_asked,
    stop_error,
)
from outbox_dispatch.store import Store
from outbox_dispatch.store.pool import Conn
from outbox_dispatch.worker.heartbeat import Running
from outbox_dispatch.worker.messages import (
    Result,
    describe_error,
    describe_traceback,
    row_fields,
)
from outbox_dispatch.worker.slots import CapSlots

log = logging.getLogger(__name__)


class Settler:
    """Applies the settles of one database's rows."""

    def __init__(self, store: Store, families: Mapping[str, Family], slots: CapSlots) -> None:
        self.store = store
        self.families = families
        self.slots = slots

    def hand_back_unrun(self, started: Started, family: Family, exc: Exception) -> Result:
        """A transactional handler that got no connection for its transaction (its pool, or
        Postgres, ran out of them) never ran: its row goes back uncounted, due now, for a
        worker that has one, rather than spending an attempt."""
        self.store.handback(started.id, started.token)
        self.slots.release(started, family)
        self.slots.on_slot_freed(family.name, self.slots.caps_database)  # claim it now
        event(log, logging.WARNING, "handed_back", f"{exc}; not run", **row_fields(started))
        return Result(Outcome.STALE, started.id, str(exc))

    def failed_checks(self, started: Started, family: Family | None) -> Result:
        """The checks before a handler runs, for rows that fail them."""
        if family is None:
            error = (
                f"family {started.family!r} is not declared in this worker: "
                "declare it with dispatcher.family() and retry the parked row"
            )
            return self.finish(started, None, Settle(SettleKind.PARK, error=error))
        if started.cancel_requested:  # cancelled while on its way here: never runs
            return self.finish(started, family, Settle(SettleKind.CANCEL))
        error = (
            f"no handler for command {started.command!r} in this worker: "
            "register it with @dispatcher.handler and run `outbox-dispatch parked retry`"
        )
        return self.finish(started, family, Settle(SettleKind.PARK, error=error))

    def finish(
        self,
        started: Started,
        family: Family | None,
        settle: Settle,
        elapsed: float = 0.0,
        *,
        release: bool = True,
    ) -> Result:
        """Apply the settle decided for an attempt, and say what it came to; ``release``: give
        the row's cap slot back afterwards (not when it went back as its handler returned)."""
        applied = self.settle(settle, started, family, release=release)
        due_in = settle.delay if applied is SettleKind.RETRY else None
        result = Result(
            outcome(applied), started.id, settle.error or "", due_in, settle.traceback or ""
        )
        report(started, result, settle, elapsed)
        return result

    def settle(
        self,
        settle: Settle,
        started: Started,
        family: Family | None,
        *,
        conn: Conn | None = None,
        release: bool = True,
        or_cancel: bool = True,
    ) -> SettleKind | None:
        """Settle fenced by the token (a pending cancel request wins); then free the cap slot
        so the claimer lets one waiting row of the actor in."""
        options: dict[str, Any] = {
            "delay": settle.delay,
            "error": settle.error,
            "conn": conn,
            "or_cancel": or_cancel,
            "maybe_applied": settle.maybe_applied,
            "traceback": settle.traceback,
        }
        if family is not None and family.ordered and started.actor is not None:
            applied = self.store.settle_in_line(
                settle.kind,
                started.id,
                started.token,
                family=family.name,
                actor=started.actor,
                parked_blocks=family.parked_blocks,
                **options,
            )
        else:
            applied = self.store.settle(settle.kind, started.id, started.token, **options)
        if release:
            self.slots.release(started, family)
        return applied

    def refused(self, kind: SettleKind, started: Started) -> None:
        """A deferred settle the batch statement skipped: a cancel request arrived, or the
        claim was lost; the one-row path records which (the row's cap slot went back when
        its handler returned)."""
        family = self.families.get(started.family) or Family(started.family)
        self.finish(started, family, Settle(kind), release=False)


def after_exception(
    started: Started, family: Family, exc: Exception, running: Running, rand: Callable[[], float]
) -> Settle:
    """A handler that raised: parked at once for PermanentFailure, else a failed attempt
    (the error says when it had been told to stop, or ran past its time limit)."""
    where = describe_traceback(exc)
    if isinstance(exc, PermanentFailure):
        return Settle(SettleKind.PARK, error=describe_error(exc), traceback=where)
    stop = running.stop_reason()
    if isinstance(exc, RetryLater) and stop is None:
        return retry_asked(family, started.attempts, exc.delay, str(exc))  # asked: no failure
    if type(exc).__name__ == "SoftTimeLimitExceeded":  # billiard's, raised by prefork
        stop = StopReason.TIME_LIMIT
    error = stop_error(family, describe_error(exc), stop)
    return replace(after_failure(family, started.attempts, rand(), error), traceback=where)


def never_awaited(returned: object) -> str:
    """Why a row whose handler returned an awaitable (a coroutine, a future) is parked: nothing
    here awaits it, so its work did not run. The coroutine is closed, unrun."""
    close = getattr(returned, "close", None)
    if callable(close):  # a coroutine never awaited would warn when collected
        close()
    return (
        f"the handler returned {type(returned).__name__}, which nothing awaits: handlers are "
        "plain functions run in Celery's pool processes, so its work did not run; make it "
        "synchronous (it may call asyncio.run(...)) and retry the parked row"
    )


def report(started: Started, result: Result, settle: Settle, elapsed: float) -> None:
    """The log line of a settled attempt."""
    fields = row_fields(started)
    match result.outcome:
        case Outcome.DELIVERED:
            message = f"handler ok in {elapsed * 1000:.1f} ms"
            event(log, logging.INFO, "delivered", message, **fields)
        case Outcome.RETRIED:
            message = f"handler failed, due again in {settle.delay:.1f} s: {settle.error}"
            event(log, logging.WARNING, "retried", message, **fields)
        case Outcome.PARKED:
            message = (
                f"row parked: {settle.error} (inspect with "
                f"`outbox-dispatch --app APP parked show {started.id}`)"
            )
            if settle.traceback:
                message += "\n" + settle.traceback
            event(log, logging.ERROR, "parked", message, **fields)
        case Outcome.CANCELLED:
            event(log, logging.INFO, "cancelled", "row settled as cancelled", **fields)
        case _:
            message = (
                "the claim no longer holds (lease ran out and the row was claimed again); "
                "the result of this attempt is discarded"
            )
            event(log, logging.WARNING, "settle_refused", message, **fields)
