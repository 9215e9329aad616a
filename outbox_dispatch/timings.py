"""Every timing window of the hot path, in one place: each name says what it trades."""

from __future__ import annotations

# Celery's soft time limit is timed from when the pool process accepted the message, a moment
# before the delivery task runs: a handler still running this close to it is judged stopped.
# Trades: a handler that returns within this much of the limit is retried (maybe_applied).
SOFT_LIMIT_MARGIN = 0.05
