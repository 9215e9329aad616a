"""A delivery message and what comes of it: the (row id, claim token) pairs it names, and each
row's Result."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import Outcome

MAX_ERROR_LENGTH = 4000


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    row_id: int | None
    detail: str = ""  # the error of a retried or parked attempt, why a message was stale
    due_in: float | None = None  # retried: seconds until the row is due again
    traceback: str = ""  # retried or parked: where the handler failed


def parse_message(args: tuple[Any, ...]) -> tuple[int, UUID] | None:
    """A delivery message is exactly (row id, claim token); anything else is garbage."""
    if len(args) != 2:
        return None
    row_id, token = args
    if isinstance(row_id, bool) or not isinstance(row_id, int) or row_id <= 0:
        return None
    if not isinstance(token, str):
        return None
    try:
        return row_id, UUID(token)
    except ValueError:
        return None


MAX_BATCH = 1000


def parse_batch(args: tuple[Any, ...]) -> list[tuple[int, UUID]] | None:
    """A batched message is one list of [row id, claim token] pairs."""
    if len(args) != 1 or not isinstance(args[0], list) or not 0 < len(args[0]) <= MAX_BATCH:
        return None
    pairs = []
    for item in args[0]:
        pair = parse_message(tuple(item)) if isinstance(item, list | tuple) else None
        if pair is None:
            return None
        pairs.append(pair)
    return pairs


def message_args(pairs: list[tuple[int, UUID]]) -> tuple[Any, ...]:
    """The args of a delivery message naming ``pairs`` (parse_message, parse_batch)."""
    if len(pairs) == 1:
        return (pairs[0][0], str(pairs[0][1]))
    return ([[i, str(t)] for i, t in pairs],)


class GoesBack(Exception):
    """The rows of a message that did not start because this process got no database
    connection in time: the message goes back to its queue with them, for a process that has
    one. ``done``: the results of the message's rows before them."""

    def __init__(
        self, pairs: list[tuple[int, UUID]], cause: Exception, done: list[Result] | None = None
    ) -> None:
        super().__init__(str(cause))
        self.pairs = pairs
        self.cause = cause
        self.done = done or []

    def message(self, database: str | None) -> tuple[Any, ...]:
        """The args of the message that goes back, naming ``database`` (None: the first)."""
        head = () if database is None else (database,)
        return head + message_args(self.pairs)


MAX_TRACEBACK = 8192  # characters of a failed attempt's traceback kept on its row


def describe_traceback(exc: BaseException) -> str:
    """Where a handler failed: the exception's traceback as Python prints it, with database
    URLs masked. Past MAX_TRACEBACK characters the innermost frames are kept (the handler's
    own), the outer ones cut, and the exception's text shortened."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    if len(text) <= MAX_TRACEBACK:
        return mask_dsn(text)
    last = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()[:1000]
    frames = traceback.format_tb(exc.__traceback__)
    kept: list[str] = []
    room = MAX_TRACEBACK - len(last) - 100
    for frame in reversed(frames):
        if len(frame) > room:
            break
        kept.insert(0, frame)
        room -= len(frame)
    cut = len(frames) - len(kept)
    head = "Traceback (most recent call last):\n"
    head += f"  ...({cut} outer frames cut)\n" if cut else ""
    return mask_dsn(head + "".join(kept) + last)[:MAX_TRACEBACK]


def describe_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return mask_dsn(text)[:MAX_ERROR_LENGTH]  # a handler's own DB error may quote its URL


def row_fields(s: Started) -> dict[str, Any]:
    """The row fields of a started row's log lines."""
    return {
        "row_id": s.id,
        "family": s.family,
        "command": s.command,
        "actor": s.actor,
        "attempt": s.attempts,
    }
