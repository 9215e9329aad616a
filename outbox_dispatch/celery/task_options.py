"""A Celery task call turned into an outbox row, pure: what ``.apply_async()`` asked for
becomes the row's payload (the task's args and kwargs), due time, queue and dedupe key, or is
refused at the call with the reason. Results, callbacks, chords, chains and groups need
Celery's result machinery, which a row does not have; refusing them at the call means nobody
finds out at delivery that the second half of their workflow never ran.

tasks.py does the I/O (the transaction, the insert); this module only decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from outbox_dispatch.core.errors import InvalidArgument, InvalidPayload

_NEXT_STEP = "write the next step as a call from inside the task (it goes through the outbox too)"

# Options that need results or workflows: refused, with what to do instead.
REFUSED: dict[str, str] = {
    "link": f"callbacks (link=) run on a task's result, which the outbox does not keep: "
    f"{_NEXT_STEP}",
    "link_error": f"error callbacks (link_error=) are not run from the outbox: {_NEXT_STEP}",
    "chain": f"chains pass each task's result to the next, which the outbox does not keep: "
    f"{_NEXT_STEP}",
    "chord": "chords wait for a group's results, which the outbox does not keep",
    "group_id": "groups collect their tasks' results, which the outbox does not keep: call each "
    "task on its own",
    "group_index": "groups collect their tasks' results, which the outbox does not keep",
    "reply_to": "replies (RPC results) are not sent from the outbox",
    "time_limit": "a call's own time limit does not apply: set the family's time_limit",
    "soft_time_limit": "a call's own time limit does not apply: set the family's time_limit",
}

# Options about the Celery message itself: the outbox sends its own message, so they have no
# effect (documented in docs/celery-tasks.md).
IGNORED = frozenset(
    {
        "add_to_parent",
        "argsrepr",
        "compression",
        "connection",
        "delivery_mode",
        "exchange",
        "exchange_type",
        "headers",
        "ignore_result",
        "immediate",
        "kwargsrepr",
        "mandatory",
        "priority",
        "producer",
        "publisher",
        "retry",
        "retry_policy",
        "routing_key",
        "serializer",
        "shadow",
    }
)

# Ours or mapped: see plan_call.
MAPPED = frozenset({"countdown", "eta", "expires", "queue", "task_id", "actor", "dedupe_key"})


@dataclass(frozen=True)
class TaskCall:
    """What one ``apply_async`` asked for, as a row."""

    payload: dict[str, Any]
    delay: timedelta | None
    at: datetime | None
    queue: str | None
    dedupe_key: str | None
    actor: str | None
    task_id: str | None = None  # the call's own id (``self.request.id``), kept in the payload


def plan_call(
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    *,
    now: datetime,
    tz: tzinfo = UTC,
) -> TaskCall:
    """The row for ``task.apply_async(args, kwargs, **options)``; ``tz`` is the app's
    timezone, which Celery applies to a naive ``eta``. Raises InvalidArgument for an option
    the outbox cannot honour, InvalidPayload for arguments JSON cannot carry."""
    for key, why in REFUSED.items():  # in this order: a group's reply_to is not its point
        if options.get(key) not in (None, [], ()):
            raise InvalidArgument(f"{name}.apply_async({key}=...) is refused: {why}")
    for key in options:
        if key not in REFUSED and key not in IGNORED and key not in MAPPED:
            raise InvalidArgument(
                f"{name}.apply_async() got option {key!r}, which the outbox does not know: "
                f"it maps {sorted(MAPPED)} and ignores Celery's message options"
            )
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None and eta is not None:
        raise InvalidArgument(f"{name}.apply_async(): give countdown or eta, not both")
    delay = None if countdown is None else _countdown(name, countdown)
    at = None if eta is None else _aware(name, "eta", eta, tz)
    payload = encode_call(name, args, kwargs)
    expires = options.get("expires")
    if expires is not None:
        payload["expires"] = _expiry(name, expires, now, tz).isoformat()
    task_id = _text(name, "task_id", options.get("task_id"))
    if task_id is not None:
        payload["id"] = task_id
    # a task_id dedupes calls of this task only (the dedupe key is global); dedupe_key wins
    dedupe = _text(name, "dedupe_key", options.get("dedupe_key"))
    if dedupe is None and task_id is not None:
        dedupe = f"{name}:{task_id}"
    return TaskCall(
        payload=payload,
        delay=delay,
        at=at,
        queue=_queue_name(name, options.get("queue")),
        dedupe_key=dedupe,
        actor=_text(name, "actor", options.get("actor")),
        task_id=task_id,
    )


def encode_call(name: str, args: Any, kwargs: Any) -> dict[str, Any]:
    """The payload of a task call: args and kwargs as Celery's JSON serializer writes them
    (kombu's, so a datetime, UUID, Decimal or bytes argument arrives as one, as it would
    through Celery)."""
    from kombu.utils.json import dumps

    if args is None:
        args = ()
    if kwargs is None:
        kwargs = {}
    if not isinstance(args, list | tuple):
        raise InvalidArgument(f"{name}: args must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgument(f"{name}: kwargs must be a dict with str keys")
    try:
        encoded = json.loads(dumps({"args": list(args), "kwargs": kwargs}))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(
            f"{name}'s arguments cannot be written as JSON ({exc}): pass ids and plain values, "
            "not objects"
        ) from exc
    assert isinstance(encoded, dict)
    return encoded


@dataclass(frozen=True)
class DecodedCall:
    args: list[Any]
    kwargs: dict[str, Any]
    expires: datetime | None
    task_id: str | None = None


def decode_call(payload: Any) -> DecodedCall:
    """The args and kwargs a row holds, revived as Celery would (datetimes, UUIDs...).
    Raises ValueError for a payload no task call wrote."""
    from kombu.utils.json import loads

    if not isinstance(payload, dict) or not isinstance(payload.get("args"), list):
        raise ValueError(f"not a task call's payload: {str(payload)[:200]}")
    if not isinstance(payload.get("kwargs"), dict):
        raise ValueError(f"not a task call's payload: {str(payload)[:200]}")
    revived = loads(json.dumps({"args": payload["args"], "kwargs": payload["kwargs"]}))  # type: ignore[no-untyped-call]
    expires = payload.get("expires")
    call_id = payload.get("id")
    return DecodedCall(
        revived["args"],
        revived["kwargs"],
        None if expires is None else datetime.fromisoformat(str(expires)),
        call_id if isinstance(call_id, str) else None,
    )


def retry_delay(when: Any, default: float, now: datetime, tz: tzinfo = UTC) -> float:
    """Seconds until the retry Celery's ``Retry`` asked for: its countdown, the time until
    its eta (a naive one in the app's timezone ``tz``), or the task's
    ``default_retry_delay``; never negative."""
    if isinstance(when, datetime):
        aware = when if when.tzinfo is not None else when.replace(tzinfo=tz)
        return max(0.0, (aware - now).total_seconds())
    if isinstance(when, int | float) and not isinstance(when, bool):
        return max(0.0, float(when))
    return max(0.0, float(default))


def _countdown(name: str, value: Any) -> timedelta | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InvalidArgument(f"{name}: countdown must be seconds (a number), got {value!r}")
    if value <= 0:
        return None
    try:
        return timedelta(seconds=value)
    except OverflowError as exc:
        raise InvalidArgument(f"{name}: countdown {value!r} is out of range") from exc


def _aware(name: str, what: str, value: Any, tz: tzinfo) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise InvalidArgument(f"{name}: {what} {value!r} is not an ISO 8601 time") from exc
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{name}: {what} must be a datetime, got {type(value).__name__}")
    return value if value.tzinfo is not None else value.replace(tzinfo=tz)


def _expiry(name: str, value: Any, now: datetime, tz: tzinfo) -> datetime:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return now + timedelta(seconds=value)
        except (OverflowError, ValueError) as exc:  # ValueError: NaN
            raise InvalidArgument(f"{name}: expires {value!r} is out of range") from exc
    return _aware(name, "expires", value, tz)


def _queue_name(name: str, value: Any) -> str | None:
    if value is None:
        return None
    queue = getattr(value, "name", value)  # a kombu Queue or its name
    if not isinstance(queue, str) or not queue:
        raise InvalidArgument(f"{name}: queue must be a queue name, got {value!r}")
    return queue


def _text(name: str, what: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}: {what} must be a str, got {type(value).__name__}")
    return value
