"""The pure checks of a chaos run, from what the handlers recorded and what the outbox holds at
the end. No I/O here, so each check has unit tests that make it fail.

Times are ``time.time()`` seconds taken on one machine by the handlers (run start and end) and
by the orchestrator (kills), so they compare directly.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

# what the claim statements write when they park a row whose attempts kept ending unsettled
LOST_MARK = "ended without an outcome"
PERMANENT_MARK = "PermanentFailure"


@dataclass(frozen=True)
class Run:
    """One handler run as recorded: its start always, its end unless the process died first."""

    row_id: int
    actor: str | None
    attempt: int
    maybe_applied: bool
    pid: int
    pgid: int
    started: float
    ended: float | None = None
    ok: bool | None = None
    told_to_stop: bool = False  # ctx.is_cancelled was set: its claim or cap slot had lapsed
    # the handler's own view: it returned early, without its effect, because it saw
    # ctx.is_cancelled (what the docs ask of a handler); such an attempt delivered nothing
    gave_up: bool = False
    error: str | None = None  # the exception class a failed run raised


@dataclass(frozen=True)
class Kill:
    """A kill -9 by the orchestrator: a whole worker (its process group) or one pool process."""

    at: float
    pgid: int | None = None
    pid: int | None = None

    def hits(self, run: Run) -> bool:
        return (self.pgid is not None and run.pgid == self.pgid) or (
            self.pid is not None and run.pid == self.pid
        )


class Closed(StrEnum):
    RECORDED = "recorded"  # the handler wrote its end
    KILLED = "killed"  # its process was killed: it ran until the kill
    ASSUMED = "assumed"  # no end and no kill: assumed to run for a whole lease (conservative)


@dataclass(frozen=True)
class Span:
    """When a run of a row held its actor: from its start to its end (or its process's death)."""

    row_id: int
    actor: str | None
    start: float
    end: float
    closed: Closed
    told_to_stop: bool = False


def close_runs(runs: Iterable[Run], kills: Sequence[Kill], lease: float) -> list[Span]:
    """Give every run an end. A run without a recorded end stopped when its process was killed
    (the first kill of its pid or process group after it started); a run that has neither is
    assumed to have run for a whole lease, which can only make the overlap checks stricter."""
    by_time = sorted(kills, key=lambda k: k.at)
    spans = []
    for r in runs:
        if r.ended is not None:
            spans.append(
                Span(r.row_id, r.actor, r.started, r.ended, Closed.RECORDED, r.told_to_stop)
            )
            continue
        kill = next((k for k in by_time if k.at >= r.started and k.hits(r)), None)
        if kill is not None:
            spans.append(Span(r.row_id, r.actor, r.started, kill.at, Closed.KILLED))
        else:
            spans.append(Span(r.row_id, r.actor, r.started, r.started + lease, Closed.ASSUMED))
    return spans


@dataclass(frozen=True)
class Breach:
    """An instant when more runs of one actor overlapped than its cap allows."""

    actor: str
    at: float
    level: int
    rows: tuple[int, ...]
    # a run involved had been told to stop (its lease or slot lapsed while it still ran): the
    # overlap comes from a stalled run, not from a second grant of a live slot
    stale_run: bool


def concurrency_breaches(spans: Iterable[Span], cap: int) -> list[Breach]:
    """Interval sweep per actor; one breach per episode above the cap. At equal times an end
    comes before a start (a slot freed and taken at the same instant is not an overlap)."""
    by_actor: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.actor is not None:
            by_actor[s.actor].append(s)
    breaches = []
    for actor, group in sorted(by_actor.items()):
        events = sorted(
            [(s.start, 1, i) for i, s in enumerate(group)]
            + [(s.end, 0, i) for i, s in enumerate(group)]
        )
        active: set[int] = set()
        above = False
        for at, is_start, i in events:
            if not is_start:
                active.discard(i)
                above = above and len(active) > cap
                continue
            active.add(i)
            if len(active) > cap and not above:
                above = True
                running = [group[j] for j in sorted(active)]
                breaches.append(
                    Breach(
                        actor,
                        at,
                        len(active),
                        tuple(sorted(s.row_id for s in running)),
                        any(s.told_to_stop for s in running),
                    )
                )
    return breaches


def peak_concurrency(spans: Iterable[Span]) -> dict[str, int]:
    """The highest number of overlapping runs per actor (so a test can show the cap was hit)."""
    by_actor: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for s in spans:
        if s.actor is not None:
            by_actor[s.actor] += [(s.start, 1), (s.end, -1)]
    peaks = {}
    for actor, events in by_actor.items():
        level = top = 0
        for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # ends (-1) first
            level += step
            top = max(top, level)
        peaks[actor] = top
    return peaks


@dataclass(frozen=True)
class OrderBreach:
    actor: str
    earlier: int
    later: int
    why: str


def order_breaches(
    lines: Mapping[str, Sequence[int]], spans: Iterable[Span], succeeded: set[int]
) -> list[OrderBreach]:
    """Per actor, rows in enqueue order: a row may run only after every run of the row before
    it ended, and only if that row succeeded (a parked row holds its line)."""
    by_row: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_row[s.row_id].append(s)
    out = []
    for actor, ids in sorted(lines.items()):
        for earlier, later in itertools.pairwise(ids):
            if not by_row.get(later):
                continue
            first_start = min(s.start for s in by_row[later])
            if earlier not in succeeded:
                out.append(
                    OrderBreach(actor, earlier, later, "ran while the row before never succeeded")
                )
            elif first_start < max(s.end for s in by_row[earlier]):
                out.append(
                    OrderBreach(actor, earlier, later, "started before the row before ended")
                )
    return out


@dataclass(frozen=True)
class Duplicates:
    """Effects beyond the first per row; ``flagged`` ones ran with ``maybe_applied`` set, as the
    handler was told that an earlier attempt may have taken effect."""

    rows: int
    extra: int
    flagged: int
    unflagged: int
    unflagged_rows: tuple[int, ...]


def duplicate_effects(effects: Iterable[tuple[int, int, bool]]) -> Duplicates:
    """``effects``: (row id, attempt, maybe_applied) of each effect that took place."""
    by_row: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for row_id, attempt, maybe in effects:
        by_row[row_id].append((attempt, maybe))
    rows = extra = flagged = 0
    unflagged: list[int] = []
    for row_id, got in sorted(by_row.items()):
        if len(got) < 2:
            continue
        rows += 1
        later = sorted(got)[1:]
        extra += len(later)
        ok = sum(1 for _, maybe in later if maybe)
        flagged += ok
        if ok < len(later):
            unflagged.append(row_id)
    return Duplicates(rows, extra, flagged, extra - flagged, tuple(unflagged))


def reruns_of_one_claim(runs: Iterable[Run]) -> list[tuple[int, int]]:
    """(row id, attempt) that ran more than once. Every claim that reaches a handler counts a
    new attempt, so two runs with one attempt number mean one claim ran twice (invariant 3)."""
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for r in runs:
        seen[(r.row_id, r.attempt)] += 1
    return sorted(k for k, n in seen.items() if n > 1)


class Fate(StrEnum):
    DONE = "done"
    PARKED_EXPECTED = "parked: PermanentFailure as planned"
    PARKED_LOST = "parked: attempts kept ending without an outcome"
    PARKED_OTHER = "parked: other"
    HELD = "held behind a parked ordered head"
    CANCELLED = "cancelled"
    LIVE = "lost: still unsettled"
    VANISHED = "lost: row gone from a family that keeps done rows"
    NO_EFFECT = "lost: settled without a successful run"


LOST = frozenset({Fate.LIVE, Fate.VANISHED, Fate.NO_EFFECT})


@dataclass(frozen=True)
class Enqueued:
    """A row the producer committed (its business record commits in the same transaction)."""

    row_id: int
    family: str
    actor: str | None
    permanent: bool  # planned to raise PermanentFailure
    keeps_done: bool  # the family's retention keeps delivered rows as done


@dataclass(frozen=True)
class Final:
    """A row still in the outbox at the end."""

    row_id: int
    family: str
    actor: str | None
    done: bool = False
    parked: bool = False
    cancelled: bool = False
    blocked: bool = False
    last_error: str | None = None


def classify(
    enqueued: Iterable[Enqueued], finals: Mapping[int, Final], succeeded: set[int]
) -> dict[int, Fate]:
    """What became of every committed row. ``succeeded``: rows with a successful run (for
    transactional handlers: a committed effect). A deleted row without one was settled without
    its work being done, which is as lost as a row that never settled."""
    parked_lines = {(f.family, f.actor) for f in finals.values() if f.parked and f.actor}
    fates = {}
    for e in enqueued:
        f = finals.get(e.row_id)
        if f is None:
            if e.keeps_done:
                fate = Fate.VANISHED
            else:
                fate = Fate.DONE if e.row_id in succeeded else Fate.NO_EFFECT
        elif f.done:
            fate = Fate.DONE if e.row_id in succeeded else Fate.NO_EFFECT
        elif f.parked:
            error = f.last_error or ""
            if e.permanent and PERMANENT_MARK in error:
                fate = Fate.PARKED_EXPECTED
            elif LOST_MARK in error:
                fate = Fate.PARKED_LOST
            else:
                fate = Fate.PARKED_OTHER
        elif f.cancelled:
            fate = Fate.CANCELLED
        elif f.blocked and (f.family, f.actor) in parked_lines:
            fate = Fate.HELD
        else:
            fate = Fate.LIVE
        fates[e.row_id] = fate
    return fates


@dataclass(frozen=True)
class Verdict:
    name: str
    value: str
    limit: str
    ok: bool


def percentiles(values: Sequence[float], ps: Iterable[int]) -> dict[str, float]:
    """Nearest-rank percentiles (``p100`` is the maximum); empty input gives no figures."""
    ordered = sorted(values)
    if not ordered:
        return {}
    out = {}
    for p in ps:
        rank = max(1, -(-p * len(ordered) // 100))  # ceil(p/100 * n), at least the first
        out[f"{p}"] = round(ordered[min(rank, len(ordered)) - 1], 3)
    return out


def within(seconds: float | None, limit: float) -> bool:
    return seconds is not None and seconds <= limit


@dataclass(frozen=True)
class Unfinished:
    """A row settled as delivered by an attempt whose handler did not finish its work."""

    row_id: int
    attempt: int
    how: str


GAVE_UP = "returned early on ctx.is_cancelled"
NO_END = "no recorded end (its process died before the handler returned)"


def delivered_unfinished(runs: Iterable[Run], delivered: set[int]) -> list[Unfinished]:
    """Rows delivered by an attempt that gave up, raised, or never returned. The attempt that
    settled a row is its last to start: a settle is fenced by the claim token, and once it
    commits the row is never claimed (so never started) again. A handler that returned because
    it saw ``ctx.is_cancelled`` (time limit, lost cap slot or claim) did not do its work, so a
    "delivered" settle of its attempt loses the row as surely as a crash would."""
    last: dict[int, Run] = {}
    for r in runs:
        if r.row_id not in delivered:
            continue
        seen = last.get(r.row_id)
        if seen is None or (r.started, r.attempt) > (seen.started, seen.attempt):
            last[r.row_id] = r
    out = []
    for row_id, r in sorted(last.items()):
        if r.gave_up:
            how = GAVE_UP
        elif r.ended is None:
            how = NO_END
        elif not r.ok:
            how = f"raised {r.error or 'an exception'}"
        else:
            continue
        out.append(Unfinished(row_id, r.attempt, how))
    return out


def settle_limit(policies: Iterable[tuple[float, float | None]]) -> float:
    """Two of the longest times the outbox may legitimately take to notice a lost attempt,
    over the families of the run: ``(lease, heartbeat_timeout)`` each (a claimed message may
    wait one lease; a started attempt whose worker died is noticed one timeout later)."""
    longest = max((max(lease, hb or 0.0) for lease, hb in policies), default=0.0)
    if longest <= 0:
        raise ValueError("a settle limit needs at least one family with a lease")
    return 2 * longest
