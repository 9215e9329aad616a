"""Checks every enqueue argument before anything touches the caller's transaction.

Pure: no I/O, so a bad call fails the same way whether or not Postgres is reachable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox_dispatch.core.bounds import MAX_DELAY, MAX_ROW_ID
from outbox_dispatch.core.errors import InvalidArgument, InvalidPayload, PayloadTooLarge

MAX_KEY_LENGTH = 512
DEFAULT_PAYLOAD_LIMIT = 256 * 1024


@dataclass(frozen=True)
class Message:
    """One request for ``enqueue_many``; the same fields ``enqueue`` takes."""

    command: str
    payload: Any = None
    actor: str | None = None
    dedupe_key: str | None = None
    delay: timedelta | None = None
    at: datetime | None = None


@dataclass(frozen=True)
class PreparedRow:
    """A validated row: JSON already encoded, due time as a delay or an absolute instant."""

    family: str
    command: str
    actor: str | None
    payload_json: str
    dedupe_key: str | None
    delay_seconds: float
    at: datetime | None
    trace_json: str | None = None  # the enqueuing span's context, when tracing is on


def encode_payload(payload: Any, limit: int, what: str = "payload") -> str:
    """JSON text of the payload, or of another value bound for a jsonb column, named by
    ``what`` (a heartbeat's progress); rejects NaN/Infinity and non-string keys instead of
    coercing."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except RecursionError as exc:
        raise InvalidPayload(f"{what} is nested too deeply to encode as JSON: flatten it") from exc
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(
            f"{what} is not JSON-serializable ({exc}): pass dicts, lists, str, int, float, "
            "bool or None, and convert other types (dates, Decimals, objects) yourself"
        ) from exc
    # json.dumps silently turns int/float/bool/None dict keys into strings (the handler would
    # see other keys than were enqueued), and jsonb cannot store NUL: refuse both up front.
    _check_structure(payload, what)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidPayload(
            f"{what} has a string that is not valid Unicode ({exc.reason}): "
            "decode bytes properly first"
        ) from exc
    if size > limit:
        raise PayloadTooLarge(
            f"{what} is {size} bytes, over the {limit}-byte limit: store the bulk elsewhere "
            "(a table, object storage) and pass a reference, or raise payload_limit"
        )
    return text


def _check_structure(value: Any, what: str) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise InvalidPayload(f"{what} contains a NUL character, which jsonb cannot store")
        elif isinstance(item, Mapping):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise InvalidPayload(
                        f"{what} has a non-string key {key!r}: JSON object keys must be str"
                    )
                stack.append(key)
                stack.append(sub)
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _optional_key(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str or None, got {type(value).__name__}")
    if not value or len(value) > MAX_KEY_LENGTH:
        raise InvalidArgument(f"{what} must be 1-{MAX_KEY_LENGTH} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid Unicode ({exc.reason})") from exc
    return value


def checked_row_id(value: object, what: str = "row_id") -> int:
    """A row id as given by a caller: an int within bigint (another family's id, or one that
    does not exist, simply matches nothing)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an int, got {type(value).__name__}")
    if not -MAX_ROW_ID - 1 <= value <= MAX_ROW_ID:
        raise InvalidArgument(f"{what} {value} is out of range: row ids are 64-bit")
    return value


def row_ids(values: object) -> list[int] | None:
    """A list of row ids (None: not given)."""
    if values is None:
        return None
    if isinstance(values, str | bytes) or not isinstance(values, list | tuple | set | frozenset):
        raise InvalidArgument(f"ids must be a list of ints, got {type(values).__name__}")
    return [checked_row_id(v, "ids") for v in values]


def due_offset(delay: object, at: object) -> tuple[float, datetime | None]:
    """Seconds from the database's now, or an absolute aware instant; never both."""
    if delay is not None and at is not None:
        raise InvalidArgument("pass either delay or at, not both")
    if delay is not None:
        if not isinstance(delay, timedelta):
            raise InvalidArgument(f"delay must be a timedelta, got {type(delay).__name__}")
        seconds = delay.total_seconds()
        if seconds < 0 or not math.isfinite(seconds):
            raise InvalidArgument(f"delay must not be negative, got {delay}")
        if delay > MAX_DELAY:
            raise InvalidArgument(
                f"delay must be at most {MAX_DELAY.days} days, got {delay}: for a row that "
                "should never run, do not enqueue it"
            )
        return seconds, None
    if at is not None:
        if not isinstance(at, datetime):
            raise InvalidArgument(f"at must be a datetime, got {type(at).__name__}")
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidArgument("at must be timezone-aware (for example datetime.now(UTC))")
        if at > datetime.now(UTC) + MAX_DELAY:
            # as for delay; near year 9999 the stored instant could not be read back
            raise InvalidArgument(
                f"at must be at most {MAX_DELAY.days} days ahead, got {at.isoformat()}: for a "
                "row that should never run, do not enqueue it"
            )
        return 0.0, at
    return 0.0, None


def prepare(
    *,
    family: str,
    command: str,
    payload: Any,
    actor: object,
    dedupe_key: object,
    delay: object,
    at: object,
    payload_limit: int,
) -> PreparedRow:
    seconds, instant = due_offset(delay, at)
    return PreparedRow(
        family=family,
        command=command,
        actor=_optional_key(actor, "actor"),
        payload_json=encode_payload(payload, payload_limit),
        dedupe_key=_optional_key(dedupe_key, "dedupe_key"),
        delay_seconds=seconds,
        at=instant,
    )


def check_cancel(
    row_id: object,
    dedupe_key: object,
    actor: object,
    command: object,
    reason: object,
    by: object,
) -> None:
    """What ``cancel`` takes: exactly one of a row id, a dedupe key or an actor (a command only
    narrows an actor's rows), and strings for the rest."""
    if row_id is None and dedupe_key is None and actor is None:
        raise InvalidArgument("cancel needs a row id, a dedupe_key, or an actor")
    if sum(x is not None for x in (row_id, dedupe_key, actor)) > 1:
        # together they would narrow each other, and a row matching only one would be missed
        raise InvalidArgument(
            "cancel takes one of a row id, a dedupe_key or an actor: cancel each separately"
        )
    if command is not None and actor is None:
        raise InvalidArgument("command narrows an actor's rows: pass actor= with it")
    if row_id is not None:
        checked_row_id(row_id)
    for what, value in (
        ("dedupe_key", dedupe_key),
        ("actor", actor),
        ("command", command),
        ("reason", reason),
        ("by", by),
    ):
        if value is not None and not isinstance(value, str):
            raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
