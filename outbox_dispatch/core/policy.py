"""Family policies and the pure decisions made from them (no I/O here).

Keeping backoff and retry-or-park pure lets them be tested exhaustively and cheaply.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple

from outbox_dispatch.core.bounds import (
    MAX_BACKOFF,
    MAX_COUNT,
    MAX_LEASE,
    MAX_RETENTION,
    count_in,
    seconds_in,
)
from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.core.naming import family_name

MAX_BATCH = 1000  # rows one delivery message may carry
ADAPTIVE_BATCH = 100  # the most rows per message a family with batch=None is packed with


def require_whole(what: str, value: object, low: int = 1, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a whole number from ``low`` to MAX_COUNT (or None, when
    ``optional``): one message for every count a user gives."""
    if optional and value is None:
        return
    if not count_in(value, low):
        none = "None or " if optional else ""
        raise ConfigurationError(
            f"{what} must be {none}a whole number from {low} to {MAX_COUNT}, got {value!r}"
        )


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter: delay(n) = min(cap, base * 2**(n-1)), jittered."""

    base: float = 1.0
    cap: float = 300.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not (seconds_in(self.base, 0.0, MAX_BACKOFF) and self.base > 0):
            raise ConfigurationError(
                f"backoff base must be a number of seconds > 0 and <= {MAX_BACKOFF:g}, "
                f"got {self.base!r}"
            )
        if not (seconds_in(self.cap, 0.0, MAX_BACKOFF) and self.cap >= self.base):
            raise ConfigurationError(
                f"backoff cap must be >= base and <= {MAX_BACKOFF:g} s, got {self.cap!r}"
            )
        if not seconds_in(self.jitter, 0.0, 1.0):
            raise ConfigurationError(f"backoff jitter must be in [0, 1], got {self.jitter!r}")

    def delay(self, attempts: int, rand: float) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt; ``rand`` is uniform in [0, 1).

        Jitter only shortens the delay, so the cap is a real upper bound.
        """
        exponent = min(max(attempts, 1) - 1, 64)
        raw = min(self.cap, self.base * (2.0**exponent))
        return raw * (1.0 - self.jitter * rand)


class LostAttempt(StrEnum):
    """What an attempt that ended without an outcome (process killed, lease lost) leads to."""

    RETRY = "retry"
    PARK = "park"


@dataclass(frozen=True)
class Family:
    """A named kind of work with its own Celery queue and delivery policy."""

    name: str
    max_attempts: int | None = 10
    backoff: Backoff = field(default_factory=Backoff)
    lease: float = 60.0
    max_in_flight: int = 1000
    per_actor: int | None = None
    ordered: bool = False
    retention: float = 0.0
    on_lost: LostAttempt = LostAttempt.RETRY
    parked_blocks: bool = True
    # rows per delivery message: None sizes each claim's messages from its backlog (one row
    # per message at low load); n caps that at n, and 1 pins one row per message
    batch: int | None = None
    max_lost: int = 5  # consecutive attempts without an outcome before the row is parked
    time_limit: float | None = None  # seconds a handler may run before its attempt is ended
    # seconds a started attempt may go without a heartbeat before it counts as lost; ``lease``
    # is only how long a claimed message may wait in the queue before it starts
    heartbeat_timeout: float = 30.0

    def __post_init__(self) -> None:
        family_name(self.name)
        named = f"family {self.name!r}:"
        require_whole(
            f"{named} max_attempts (None retries forever)", self.max_attempts, optional=True
        )
        require_whole(f"{named} max_in_flight", self.max_in_flight)
        require_whole(f"{named} per_actor", self.per_actor, optional=True)
        require_whole(f"{named} max_lost", self.max_lost)
        if not isinstance(self.backoff, Backoff):
            raise ConfigurationError(
                f"family {self.name!r}: backoff must be a Backoff(base, cap, jitter), got "
                f"{self.backoff!r}"
            )
        for flag in ("ordered", "parked_blocks"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(
                    f"family {self.name!r}: {flag} must be True or False, got "
                    f"{getattr(self, flag)!r}"
                )
        if not seconds_in(self.lease, 1.0, MAX_LEASE):
            raise ConfigurationError(
                f"family {self.name!r}: lease must be 1 s to {MAX_LEASE:g} s, got {self.lease!r}"
            )
        if not seconds_in(self.heartbeat_timeout, 1.0, MAX_LEASE):
            raise ConfigurationError(
                f"family {self.name!r}: heartbeat_timeout must be 1 s to {MAX_LEASE:g} s, "
                f"got {self.heartbeat_timeout!r}"
            )
        if not (self.retention == math.inf or seconds_in(self.retention, 0.0, MAX_RETENTION)):
            raise ConfigurationError(
                f"family {self.name!r}: retention must be 0 to {MAX_RETENTION:g} seconds, or "
                f"math.inf (or timedelta.max) to keep settled rows forever; got {self.retention!r}"
            )
        if self.time_limit is not None and not (
            seconds_in(self.time_limit, 0.0, MAX_LEASE) and self.time_limit > 0
        ):
            raise ConfigurationError(
                f"family {self.name!r}: time_limit must be None or 0 to {MAX_LEASE:g} seconds"
            )
        if self.batch is not None and (
            isinstance(self.batch, bool)
            or not isinstance(self.batch, int)
            or not 1 <= self.batch <= MAX_BATCH
        ):
            raise ConfigurationError(
                f"family {self.name!r}: batch must be None (sized per claim) or 1-{MAX_BATCH} "
                f"rows per message, got {self.batch!r}"
            )
        if self.ordered and self.per_actor is not None:
            raise ConfigurationError(
                f"family {self.name!r}: an ordered family runs one row per actor at a time "
                "already; drop per_actor"
            )

    def hard_time_limit(self) -> float | None:
        """Past the soft limit (which raises inside the handler), the process is killed: a
        handler that swallows the soft limit still ends."""
        if self.time_limit is None:
            return None
        return self.time_limit + max(1.0, self.time_limit * 0.1)

    @property
    def most_per_message(self) -> int:
        return ADAPTIVE_BATCH if self.batch is None else self.batch

    def with_policy(self, **changes: object) -> Family:
        return replace(self, **changes)  # type: ignore[arg-type]


def builtin_families() -> dict[str, Family]:
    """``intent``: messages between services, retried forever on a short lease.
    ``job``: bounded work with a longer lease, the family that caps apply to.
    """
    return {
        "intent": Family(
            "intent",
            max_attempts=None,
            backoff=Backoff(base=1.0, cap=300.0),
            lease=30.0,
            max_in_flight=2000,
        ),
        "job": Family(
            "job",
            max_attempts=5,
            backoff=Backoff(base=2.0, cap=600.0),
            lease=300.0,
            max_in_flight=500,
        ),
    }


class Verdict(StrEnum):
    RETRY = "retry"
    PARK = "park"


@dataclass(frozen=True)
class FailureDecision:
    verdict: Verdict
    delay: float = 0.0


def decide_failure(
    family: Family, attempts: int, rand: float, *, permanent: bool = False
) -> FailureDecision:
    """After a failed attempt: park if the failure is permanent or attempts ran out, else retry."""
    if permanent:
        return FailureDecision(Verdict.PARK)
    if family.max_attempts is not None and attempts >= family.max_attempts:
        return FailureDecision(Verdict.PARK)
    return FailureDecision(Verdict.RETRY, family.backoff.delay(attempts, rand))


def starts_flushed(family: Family | None, flushed_starts: bool) -> bool:
    """Whether a delivery start waits for its WAL flush before the handler runs.

    By default it does not: the claim before it is flushed instead, so after a crash of
    Postgres a row whose start was lost still shows its claim, older than the server's start,
    and is taken as possibly started (it runs again with ``maybe_applied``, after its lease).
    A family that parks lost attempts flushes its starts, so that a Postgres restart does not
    park rows that never ran; an unknown family flushes (the safe side); and
    ``flushed_starts`` makes every start flush, for a failover to a synchronous standby, whose
    own start time says nothing of the commits it never received."""
    return flushed_starts or family is None or family.on_lost is LostAttempt.PARK


# Messages per consumer a claim under backlog aims for: several, so that no consumer idles
# while another works through a long message, and few, so that each carries many rows.
SPREAD = 4
# The share of a family's lease one message's rows may take, by their measured run time: a
# message's last row starts well inside the lease its claim gave it.
LEASE_SHARE = 0.1


def rows_per_message(
    rows: int,
    *,
    most: int,
    consumers: int,
    queued: int,
    run_time: float | None,
    lease: float,
) -> int:
    """How many of a claim's ``rows`` each delivery message carries.

    A claim that found no more rows than there are consumers sends one row per message: low
    load keeps its latency and Flower's one task per row. Under a backlog the rows are spread
    over ``SPREAD`` messages per consumer, fewer when the family's queue already holds
    ``queued`` messages (the consumers are busy), and never more rows than the handlers'
    measured ``run_time`` gets through in a tenth of the lease, nor more than ``most``.
    """
    if most <= 1 or rows <= max(1, consumers):
        return 1
    messages = max(consumers * SPREAD - queued, consumers, 1)
    size = math.ceil(rows / messages)
    if run_time is not None and run_time > 0:
        size = min(size, max(1, int(lease * LEASE_SHARE / run_time)))
    return max(1, min(size, most))


def batch_after_cancel(tried: int) -> int:
    """The most rows a family's next claim takes after the server cancelled a claim of
    ``tried`` rows (a ``statement_timeout`` shorter than a big claim, a capped backlog's
    first ones above all): half, so that a claim that finishes in time is found within a few
    passes, where the family would otherwise never be claimed."""
    return max(1, tried // 2)


def batch_after_claim(cut: int, batch: int) -> int | None:
    """The next limit after a claim under ``cut`` went through: doubled, back towards the
    claimer's ``batch`` (None once it is reached: no cut left)."""
    grown = cut * 2
    return None if grown >= batch else grown


def claim_can_wait(queued_messages: int, consumers: int, most_per_message: int) -> bool:
    """Whether a claim that its caller makes again within a refill interval (the commit
    listener's) leaves the family's due rows for then: while the family's queue holds SPREAD
    messages for every consumer, rows claimed now would only wait behind them, and a claim of
    the few rows that came due since the last one costs a round trip and a message per row.
    Left in Postgres, they are taken together by a later claim, which packs them
    (rows_per_message), so a backlog built by a stream of one-row commits is not claimed a few
    rows at a time while it grows. A family pinned to one row per message is always claimed:
    its claim cannot pack, and SPREAD one-row messages per consumer may run out before the next
    claim."""
    return most_per_message > 1 and queued_messages >= max(1, consumers) * SPREAD


def broker_room(max_in_flight: int, queued_messages: int, rows_per_message: int) -> int:
    """Rows a claim may add to the family's broker queue. Messages that waited past their
    lease are stale but still queued; counting only live leases, a claimer would re-claim and
    republish their rows again and again while the queue grew without bound.

    Room below the refill mark counts as none: while the queue holds three quarters of what
    the family may have in flight, the workers have plenty to do, and a claim that tops it up
    a few rows at a time pays a full in-flight count for each few rows."""
    room = max(0, max_in_flight - queued_messages * rows_per_message)
    return room if room >= refill_mark(max_in_flight) else 0


def refill_mark(max_in_flight: int) -> int:
    """The least free room worth a claim: a quarter of max_in_flight (at least one row)."""
    return max(1, max_in_flight // 4)


@dataclass(frozen=True)
class CapRule:
    """The cap a row's slot counts against: the family's (scope "") or its command's own, each
    a semaphore of its own, so a command capped at 1 never waits behind another command's
    slots of the same actor."""

    scope: str
    limit: int


def cap_rule(
    family: Family, command: str, command_cap: int | None, actor: str | None
) -> CapRule | None:
    """The one rule for whether a row is capped: rows without an actor are not, ordered
    families run one row per actor and take no slots, and a command's own ``per_actor`` wins
    over its family's."""
    if actor is None or family.ordered:
        return None
    if command_cap is not None:
        return CapRule(command, command_cap)
    if family.per_actor is not None:
        return CapRule("", family.per_actor)
    return None


def family_is_capped(family: Family, has_command_caps: bool) -> bool:
    """Whether a family's claims go through the cap semaphores at all."""
    return not family.ordered and (family.per_actor is not None or has_command_caps)


class Candidate(NamedTuple):
    """A due row of a capped family, as the capped claim sees it (rank 1 = actor's oldest).
    A named tuple, because a claim makes one per row it reads and a frozen dataclass's
    ``__init__`` costs several times as much."""

    id: int
    actor: str | None
    command: str
    rank: int


@dataclass(frozen=True)
class CappedPlan:
    take: list[Candidate]  # claim these (capped ones only if their slot is granted)
    wait: list[Candidate]  # their actor is at cap: move out of the due range
    # every other candidate stays due, untouched, for the next claim


def plan_capped_claim(
    candidates: Sequence[Candidate], rule_of: Callable[[Candidate], CapRule | None], limit: int
) -> CappedPlan:
    """Which due rows a capped claim takes, given candidates in (rank, due) order.

    Greedy in rank order, so every actor's first row is considered before any actor's second
    one: a big backlog cannot crowd out small actors. At most ``cap`` rows per actor are taken;
    the actor's other rows wait out of the due range instead of filling the next probe. Rows
    without an actor or cap are uncapped and only limited by ``limit``.
    """
    take: list[Candidate] = []
    wait: list[Candidate] = []
    per_slot: Counter[tuple[str, str]] = Counter()  # (actor, cap scope) -> rows taken
    for c in candidates:
        rule = rule_of(c)
        if c.actor is None or rule is None:
            if len(take) < limit:
                take.append(c)
            continue
        key = (c.actor, rule.scope)
        if per_slot[key] >= rule.limit:
            wait.append(c)
        elif len(take) < limit:
            take.append(c)
            per_slot[key] += 1
    return CappedPlan(take, wait)
