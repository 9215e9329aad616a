"""Every timing window on a row's route, in one place; each says what it trades.

Timeouts of failure handling (the listener's retry backoff, health probes, Redis renewals)
and the run-time reports' schedule (claim/runstats.py) live with their code: they decide how a
fault is met, not how long a healthy row waits.
"""

from __future__ import annotations

# Claim: seconds between the commit listener's claims of a family held back by its
# in-flight limit or a busy queue. Shorter tops a backlog up sooner; longer packs more rows
# into each claim (fewer claims, fewer messages).
REFILL = 0.05

# Claim: seconds a family's queue length is reused by the claimer. Longer saves broker round
# trips in a burst of claims; shorter sizes each claim's messages from a fresher length.
QUEUE_TTL = 0.04

# Claim: seconds between beat's claim passes while commit listeners run (its safety net).
# Shorter claims sooner a row no listener saw; each pass costs a pool process a claim task.
SAFETY_INTERVAL = 10.0

# Caps: a release asks the claimer for a pass at most once per this many seconds per family,
# and a claim that took freed slots is claimed again this much later. Shorter lets a waiting
# row in sooner; longer costs fewer claim passes under a capped backlog.
WAKE_WINDOW = 0.05

# Settle: seconds a delivered row may wait for the next start in its process to carry its
# settle before the settles' thread writes it. Longer saves round trips under a stream of
# rows; shorter frees the row (and a dedupe key kept by it) sooner at low load.
SETTLE_WINDOW = 0.02

# Run: how often a process's heartbeat thread looks for leases to renew and time limits that
# passed. Shorter tells a handler to stop sooner; each look takes the process's GIL.
HEARTBEAT_TICK = 0.25

# Run: Celery's soft time limit is timed from when the pool process accepted the message, a
# moment before the delivery task runs: a handler still running this close to it is judged
# stopped. Longer is safer against a slow task start; a handler that returns within this much
# of its limit is retried (maybe_applied).
SOFT_LIMIT_MARGIN = 0.05
