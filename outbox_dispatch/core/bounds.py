"""The ranges every number a user gives must fall in, and the two checks that apply them.

Each bound is where a statement would otherwise fail, later and far from the call that gave
the value: an interval past Postgres' timestamp range, a count past its ``int``, an id past
``bigint``. Pure and import-free, so that errors, policy and validation all use one home.
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from decimal import Decimal

MAX_LEASE = 30 * 86400.0  # a family's lease, heartbeat timeout and time limit: 30 days
MAX_INTERVAL = MAX_LEASE  # claim_interval and prune_interval
MAX_RETENTION = 100 * 365.25 * 86400  # 100 years; math.inf keeps rows forever
MAX_BACKOFF = 365.25 * 86400  # a backoff's cap: one year
# enqueue's delay and at=, and a handler's RetryLater: far enough for any schedule, near
# enough that now() + delay stays inside Postgres' range (a longer one fails in SQL and aborts
# the caller's transaction) and that psycopg can read the instant back
MAX_DELAY = timedelta(days=100 * 366)
# Counts the SQL takes as int parameters (limits, attempts): one past this would fail every
# claim of the family in Postgres ("integer out of range").
MAX_COUNT = 2**31 - 1
MAX_ROW_ID = 2**63 - 1  # row ids are bigint


def real_seconds(value: object) -> float | None:
    """``value`` as float seconds when it is a real number (int, float, Decimal, numpy's;
    not a bool, not a string) or a timedelta; None otherwise."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real | Decimal):
        return None
    return float(value)


def seconds_in(value: object, low: float, high: float) -> bool:
    """An int or float of seconds in [low, high] (NaN, inf and bools are not); the public
    calls turn other real numbers and timedeltas into floats first (``real_seconds``)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def count_in(value: object, low: int, high: int = MAX_COUNT) -> bool:
    """A whole number in [low, high] (bools, floats and strings are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
