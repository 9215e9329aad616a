"""Durable cron: schedules declared in code, each tick written as one outbox row.

Postgres is the only scheduler: every beat process computes the same ticks, serializes on the
schedule's row in ``outbox_cron`` and writes each tick with a per-tick dedupe key, so several
beat processes still make one row per tick, also after the row was delivered and deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]

from outbox_dispatch.core.bounds import MAX_DELAY
from outbox_dispatch.core.errors import ConfigurationError

MAX_TICKS = 1000  # a catch-up never writes more rows than this per schedule and pass


class CatchUp(StrEnum):
    """After downtime: run only the latest missed tick, or every tick within the window."""

    LATEST = "latest"
    ALL = "all"


@dataclass(frozen=True)
class Schedule:
    name: str
    expr: str
    command: str
    payload: Any
    tz: str = "UTC"
    catch_up: CatchUp = CatchUp.LATEST
    window: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if not croniter.is_valid(self.expr):
            raise ConfigurationError(
                f"cron schedule {self.name!r}: {self.expr!r} is not a cron expression "
                "(five fields, or six with seconds last: '*/10 * * * * *')"
            )
        try:
            ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigurationError(
                f"cron schedule {self.name!r}: unknown time zone {self.tz!r}"
            ) from exc
        if not (isinstance(self.window, timedelta) and timedelta(0) < self.window <= MAX_DELAY):
            raise ConfigurationError(
                f"cron schedule {self.name!r}: window must be a timedelta above 0 and at most "
                f"{MAX_DELAY.days} days, got {self.window!r}"
            )
        # a valid expression that names no date ('0 0 30 2 *', a year gone by) would fail every
        # run_cron, the other schedules' ticks with it: refused here, once
        try:
            croniter(self.expr, datetime.now(UTC)).get_next(datetime)
        except Exception as exc:  # croniter's CroniterBadDateError, or worse
            raise ConfigurationError(
                f"cron schedule {self.name!r}: {self.expr!r} names no date that will come "
                f"({exc}); check the day of the month against the month"
            ) from exc

    def dedupe_key(self, tick: datetime) -> str:
        return f"cron:{self.name}:{tick.astimezone(UTC).replace(fold=0).isoformat()}"

    def payload_for(self, tick: datetime) -> Any:
        """The declared payload, with the tick's time added when it is a dict."""
        if isinstance(self.payload, dict):
            return {**self.payload, "cron_tick": tick.isoformat()}
        return self.payload


def due_ticks(
    expr: str,
    tz: str,
    last_tick: datetime,
    now: datetime,
    catch_up: CatchUp,
    window: timedelta,
) -> list[datetime]:
    """Ticks in (last_tick, now] to write, by the catch-up policy. Pure: times in, times out.

    Ticks are computed in the schedule's time zone (so '0 9 * * *' in Europe/Paris follows
    daylight saving time) and returned as aware datetimes. When the clock goes back, a schedule
    with fixed hours runs once in the repeated hour, as cron does; one with a wildcard hour
    runs in both.
    """
    zone = ZoneInfo(tz)
    once = _fixed_hours(expr)
    if catch_up is CatchUp.LATEST:
        # the latest tick at or before now; croniter's get_prev excludes now itself
        latest: datetime = croniter(
            expr, (now + timedelta(microseconds=1)).astimezone(zone)
        ).get_prev(datetime)
        if once and latest.fold:  # the repeat of a wall-clock time: its first run is the tick
            latest = latest.replace(fold=0)
        return [latest] if latest > last_tick else []
    start = max(last_tick, now - window)  # older ticks are outside the window anyway
    it = croniter(expr, start.astimezone(zone))
    ticks: list[datetime] = []
    while True:
        tick: datetime = it.get_next(datetime)
        if tick > now:
            break
        if tick > last_tick and not (once and tick.fold):
            ticks.append(tick)
    return ticks[-MAX_TICKS:]  # when more are missed, the newest are the ones to keep


def _fixed_hours(expr: str) -> bool:
    """Whether the hour field names hours (``2``, ``1-3``, ``9,17``) rather than every hour."""
    fields = expr.split()
    return len(fields) >= 5 and "*" not in fields[1]
