"""A Dispatcher's settings, checked once when they are made, so that a mistake in a setting is
an error at import time with the setting's name, not a failure in a worker later."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from outbox_dispatch.celery.tasks import OUTSIDE
from outbox_dispatch.core.bounds import MAX_INTERVAL, real_seconds, seconds_in
from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.core.naming import family_name, identifier
from outbox_dispatch.core.policy import require_whole
from outbox_dispatch.core.validation import DEFAULT_PAYLOAD_LIMIT
from outbox_dispatch.databases import database_urls


@dataclass(frozen=True)
class Settings:
    """Everything ``Dispatcher(app, ...)`` takes besides the app; docs/configuration.md says
    what each one does. ``Dispatcher(app, **options)`` builds one of these from its options."""

    database_url: str | None = None
    databases: Mapping[str, str] | None = None
    redis_url: str | None = None
    schema: str = "outbox"
    queue_prefix: str = "outbox"
    key_prefix: str = "outbox"
    claim_interval: float | timedelta = 1.0
    claim_batch: int = 500
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT
    pool_size: int = 4
    handler_pool_size: int = 32
    prune_interval: float | timedelta = 60.0
    prune_batch: int = 1000
    listen: bool = True
    consumers: int | None = None
    task_family: str = "job"
    task_outside: str | None = None  # None: "commit", with a warning once per call site
    flushed_starts: bool = False
    audit_retention: float | timedelta = timedelta(days=90)  # the operators' audit log
    # name -> URL of every database, the first one being the default
    urls: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", database_urls(self.database_url, self.databases))
        identifier(self.schema, "schema")
        identifier(self.queue_prefix, "queue_prefix")
        family_name(self.task_family)
        interval("claim_interval", self.claim_interval)
        interval("prune_interval", self.prune_interval)
        retention_seconds(self.audit_retention)
        for name in ("claim_batch", "prune_batch", "pool_size"):
            require_whole(name, getattr(self, name))
        require_whole("handler_pool_size", self.handler_pool_size, 0)  # 0: no room beyond
        require_whole("payload_limit", self.payload_limit, 2)
        require_whole("consumers", self.consumers, optional=True)
        for name in ("listen", "flushed_starts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.task_outside is not None and self.task_outside not in OUTSIDE:
            raise ConfigurationError(
                f"task_outside must be None or one of {list(OUTSIDE)}, got {self.task_outside!r}"
            )

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> Settings:
        """Settings from keyword options; an unknown name is refused with the known ones."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigurationError(
                f"Dispatcher() got unknown settings {unknown}; the settings are {sorted(known)}"
            )
        return cls(**options)

    @property
    def claim_seconds(self) -> float:
        return interval("claim_interval", self.claim_interval)

    @property
    def audit_seconds(self) -> float:
        return retention_seconds(self.audit_retention)

    @property
    def prune_seconds(self) -> float:
        return interval("prune_interval", self.prune_interval)


def interval(name: str, value: float | timedelta) -> float:
    """An interval as float seconds: any real number or a timedelta, above 0 and at most
    MAX_INTERVAL (beat's schedule and the listener's sweep take no more)."""
    seconds = real_seconds(value)
    if seconds is None or not (seconds_in(seconds, 0.0, MAX_INTERVAL) and seconds > 0):
        raise ConfigurationError(
            f"{name} must be seconds (a number or a timedelta) > 0 and <= {MAX_INTERVAL:g}, "
            f"got {value!r}"
        )
    return seconds


def seconds(value: float | timedelta) -> float:
    """Seconds as a float from any real number or a timedelta; anything else is passed on
    for the family's own check to refuse with its name."""
    found = real_seconds(value)
    return value if found is None else found  # type: ignore[return-value]


def retention_seconds(retention: object) -> float:
    """Seconds to keep settled rows; ``timedelta.max`` and ``math.inf`` mean forever."""
    if isinstance(retention, timedelta):
        return math.inf if retention == timedelta.max else retention.total_seconds()
    if isinstance(retention, bool) or not isinstance(retention, int | float):
        raise ConfigurationError(
            f"retention must be seconds or a timedelta, got {type(retention).__name__}"
        )
    return float(retention)
