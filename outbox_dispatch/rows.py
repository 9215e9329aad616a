"""The row types the store returns: what a claim leased, what a delivery started, what
status counts. Plain data, so the claimer, publisher, heartbeat and deferred settles use them
without importing the I/O module."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Holder:
    """A row whose live lease must hold a cap slot (what a caps rebuild restores)."""

    family: str
    actor: str
    command: str
    token: UUID
    remaining_ms: int


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
