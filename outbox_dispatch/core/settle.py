"""The settle decision, pure: how an attempt ended decides which settle its row gets (and so
which query of sql/settle.sql runs), and what the settle that applied means for the caller.

worker/delivery.py runs the attempt, worker/settling.py applies the decision, and
store/deliveries.py runs the query it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from outbox_dispatch.core.policy import Family, Verdict, decide_failure


class SettleKind(StrEnum):
    DELETE = "delete"  # delivered, nothing kept
    DONE = "done"  # delivered, kept for the family's retention (its dedupe key still answers)
    RETRY = "retry"  # due again after backoff
    PARK = "park"  # dead letter
    CANCEL = "cancel"  # a cancel request was pending: recorded as cancelled


QUERY: dict[SettleKind, str] = {
    SettleKind.DELETE: "settle_delete",
    SettleKind.DONE: "settle_done",
    SettleKind.RETRY: "settle_retry",
    SettleKind.PARK: "settle_park",
    SettleKind.CANCEL: "settle_cancel",
}
BATCH_QUERY: dict[SettleKind, str] = {
    SettleKind.DELETE: "settle_delete_many",
    SettleKind.DONE: "settle_done_many",
}


class Outcome(StrEnum):
    DELIVERED = "delivered"
    RETRIED = "retried"
    PARKED = "parked"
    CANCELLED = "cancelled"
    STALE = "stale"
    LOST = "lost"  # settled by nobody: the token no longer held when the handler ended


class StopReason(StrEnum):
    """Why a handler was told to stop (``ctx.is_cancelled``), and so what its return means.

    Only CANCEL_REQUESTED lets a handler's normal return settle the row (as cancelled); after
    any other reason the attempt did not finish on its own terms: it is retried (or parked
    when attempts ran out), never settled as delivered.
    """

    CANCEL_REQUESTED = "the row was cancelled"
    TIME_LIMIT = "the handler ran past its family's time_limit"
    SLOT_LAPSED = "the row's cap slot lapsed (another row of the actor may hold it now)"
    CLAIM_LOST = "the claim was lost (the lease ran out and the row is due again)"


@dataclass(frozen=True)
class Settle:
    """What to do with an attempt's row; every settle is fenced by the claim token."""

    kind: SettleKind
    delay: float = 0.0
    error: str | None = None
    maybe_applied: bool = False  # retry: the next attempt is told this one's effects are unknown
    traceback: str | None = None  # retry, park: where the handler failed (last_traceback)

    @property
    def delivers(self) -> bool:
        return self.kind in (SettleKind.DELETE, SettleKind.DONE)


def delivered(family: Family) -> Settle:
    return Settle(SettleKind.DONE if family.retention > 0 else SettleKind.DELETE)


def after_failure(
    family: Family, attempts: int, rand: float, error: str, *, maybe_applied: bool = False
) -> Settle:
    """A failed attempt: due again after backoff, or parked when attempts ran out."""
    decision = decide_failure(family, attempts, rand)
    if decision.verdict is Verdict.PARK:
        return Settle(SettleKind.PARK, error=error)
    return Settle(SettleKind.RETRY, decision.delay, error, maybe_applied)


def retry_asked(family: Family, attempts: int, delay: float, error: str) -> Settle:
    """A handler that asked to be tried again after ``delay`` (RetryLater): due again then,
    unless the family's max_attempts ran out."""
    if family.max_attempts is not None and attempts >= family.max_attempts:
        return Settle(SettleKind.PARK, error=f"{error}; the family's max_attempts ran out")
    return Settle(SettleKind.RETRY, max(0.0, delay), error)


def after_return(family: Family, attempts: int, rand: float, stop: StopReason | None) -> Settle:
    """A handler that returned: delivered, unless it had been told to stop for a reason other
    than a cancel (invariant 12) — then it did not finish on its own terms, its effects are
    unknown, and it is retried (maybe_applied) or parked. After a cancel request the
    delivered settle yields to the request and records the cancel."""
    if stop is None or stop is StopReason.CANCEL_REQUESTED:
        return delivered(family)
    return after_failure(family, attempts, rand, stop_error(family, None, stop), maybe_applied=True)


def stop_error(family: Family, error: str | None, stop: StopReason | None) -> str:
    """The row's last_error for an attempt that raised ``error`` and/or was told to stop."""
    if stop is StopReason.TIME_LIMIT:
        limit = f"{family.time_limit:g} s" if family.time_limit is not None else "its limit"
        return (
            f"handler ran past the family's time_limit of {limit} and was told to stop; "
            "make it faster, or raise time_limit"
        )
    if error is None:
        assert stop is not None
        return f"attempt stopped before it finished: {stop.value}"
    if stop is not None and stop is not StopReason.CANCEL_REQUESTED:
        return f"{error} (after being told to stop: {stop.value})"
    return error


OUTCOME: dict[SettleKind, Outcome] = {
    SettleKind.DELETE: Outcome.DELIVERED,
    SettleKind.DONE: Outcome.DELIVERED,
    SettleKind.RETRY: Outcome.RETRIED,
    SettleKind.PARK: Outcome.PARKED,
    SettleKind.CANCEL: Outcome.CANCELLED,
}


def outcome(applied: SettleKind | None) -> Outcome:
    """What a settle meant: the one that applied (the one asked for, or the cancel when a
    cancel request was pending); None: the claim no longer held, the attempt is lost."""
    return Outcome.LOST if applied is None else OUTCOME[applied]


def leaves_line(applied: SettleKind | None, parked_blocks: bool) -> bool:
    """Whether a settle of an ordered head lets the actor's next row become the head."""
    if applied in (SettleKind.DELETE, SettleKind.DONE, SettleKind.CANCEL):
        return True
    return applied is SettleKind.PARK and not parked_blocks
