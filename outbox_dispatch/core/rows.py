"""The row types the store returns: what a claim leased, what a delivery started, what
status counts, and an operator's view of one row. Plain data, so the claimer, publisher,
heartbeat and deferred settles use them without importing the I/O module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass(frozen=True)
class Claimed:
    """A row leased by a claim, as the claimer publishes it."""

    id: int
    token: UUID
    command: str
    actor: str | None
    attempts: int


@dataclass(frozen=True)
class ClaimResult:
    family: str
    claimed: list[Claimed]
    parked: list[int]
    limit: int
    waiting: int = 0
    parked_actors: tuple[str, ...] = ()
    freed: int = 0  # freed cap slots the claim took from Redis (capped families)


@dataclass(frozen=True)
class Holder:
    """A row whose live lease must hold a cap slot (what a caps rebuild restores)."""

    family: str
    actor: str
    command: str
    token: UUID
    remaining_ms: int


@dataclass(frozen=True)
class LapsedHolder:
    """A started attempt whose lease ran out (its worker died or stalled): the cap slot its
    claim took is given back by the next capped claim of its family."""

    actor: str
    command: str
    token: UUID


# What a capped claim's decision returns: rows to lease with their tokens, rows to set waiting.
CappedDecision = tuple[list[tuple[int, UUID]], list[int]]


@dataclass(frozen=True)
class Started:
    """A row whose delivery began: its token held, its lease was renewed, its payload loaded."""

    id: int
    token: UUID
    family: str
    command: str
    actor: str | None
    payload: Any
    attempts: int
    maybe_applied: bool
    dedupe_key: str | None
    cancel_requested: bool = False
    waited: float | None = None  # seconds from due (for a row due at enqueue: commit) to start
    trace_context: dict[str, str] | None = None  # the enqueuing span's W3C context
    claim_age: float | None = None  # seconds since its claim (which took its cap slot)


@dataclass(frozen=True)
class FamilyStatus:
    family: str
    due: int
    scheduled: int
    in_flight: int
    parked: int
    cancelled: int
    done: int
    oldest_due_age: float
    maybe_applied: int = 0  # unsettled rows whose earlier attempt ended without an outcome
    waiting: int = 0  # capped rows whose actor is at its cap
    blocked: int = 0  # ordered rows behind their actor's head
    actors_at_cap: int = 0
    database: str = "default"  # which of the dispatcher's databases these counts are of
    paused: bool = False  # its due rows are not claimed until it is resumed


# -- an operator's view of one row (pure): its state, and what happened to it when ------------

STATE_WORDS = {
    "due": "due",
    "scheduled": "scheduled",
    "in_flight": "in flight",
    "waiting": "waiting for a cap slot",
    "blocked": "blocked behind its actor's head",
    "parked": "parked",
    "done": "delivered (kept by retention)",
    "cancelled": "cancelled",
}


def state_of(row: Mapping[str, Any], now: datetime) -> str:
    """A row's state (a key of STATE_WORDS), from its columns; ``due_at`` None means
    'infinity' (blocked)."""
    if row.get("parked_at") is not None:
        return "parked"
    if row.get("cancelled_at") is not None:
        return "cancelled"
    if row.get("done_at") is not None:
        return "done"
    if row.get("waiting"):
        return "waiting"
    if row.get("blocked"):
        return "blocked"
    due = row.get("due_at")
    if due is not None and due > now:
        return "in_flight" if row.get("claimed") or row.get("claim_token") else "scheduled"
    return "due"


def history(row: Mapping[str, Any]) -> list[tuple[datetime, str]]:
    """What the row's columns say happened to it, oldest first: enqueued, the last claim and
    start, and how it ended (or when it is due)."""
    events: list[tuple[datetime, str]] = []

    def add(column: str, text: str) -> None:
        when = row.get(column)
        if when is not None:
            events.append((when, text))

    attempts = int(row.get("attempts") or 0)
    add("created_at", f"enqueued (command {row.get('command')}, actor {row.get('actor') or '-'})")
    add("claimed_at", f"claimed for attempt {attempts + (0 if row.get('started_at') else 1)}")
    add("started_at", f"attempt {attempts} started")
    error = row.get("last_error")
    add("parked_at", f"parked after {attempts} attempts: {error or 'no error recorded'}")
    who = row.get("cancelled_by") or "someone"
    why = row.get("cancel_reason") or "no reason given"
    add("cancelled_at", f"cancelled by {who}: {why}")
    add("done_at", "delivered")
    live = all(row.get(c) is None for c in ("parked_at", "cancelled_at", "done_at"))
    if live and not row.get("claimed"):
        again = f" (last error: {error})" if attempts and error else ""
        add("due_at", ("due again" if attempts else "due") + again)
    return sorted(events, key=lambda e: e[0])


@dataclass(frozen=True)
class RowFilter:
    """An operator's bulk selection: every parked (or, for cancel, pending) row of a family,
    command and actor, whose last error contains ``error``, older than ``older_than``
    seconds; None matches anything."""

    family: str | None = None
    command: str | None = None
    actor: str | None = None
    error: str | None = None
    older_than: float | None = None

    def params(self, parked: bool) -> dict[str, object]:
        """The query's parameters; the error text matches literally (LIKE's wildcards are
        escaped)."""
        error = self.error
        if error is not None:
            error = error.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return {
            "parked": parked,
            "family": self.family,
            "command": self.command,
            "actor": self.actor,
            "error": error,
            "older": self.older_than,
        }

    def shown(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v is not None}
