"""From what a chaos run recorded to its report: figures, verdicts and the printed table.

``assess`` takes the records read back from the private Postgres (``Records``) and what the
orchestrator knows (``Facts``: faults, kills, timing) and does no I/O, so a report can be
rebuilt from the CSV files a run leaves behind.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from outbox_dispatch.core.tables import table

from . import checks
from .checks import Enqueued, Fate, Final, Kill, Run, Span, Verdict
from .workload import CAP, CAPPED, FAMILIES

# the outbox columns a row's printed state leads with; any others follow (payload and trace
# context left out: they say nothing about why a row is stuck)
STATE_COLUMNS = (
    "id",
    "family",
    "command",
    "actor",
    "attempts",
    "claim_token",
    "claimed_at",
    "started_at",
    "due_at",
    "due_since",
    "waiting",
    "blocked",
    "parked_at",
    "cancelled_at",
    "done_at",
    "lost_attempts",
    "maybe_applied",
    "last_error",
)
STATE_OMITTED = frozenset({"payload", "trace_context"})
SHOWN_ROWS = 30  # unsettled rows printed in full; the rest are counted


@dataclass
class Fault:
    """One injected fault, as the progress log and the report show it."""

    t: float  # seconds since the fault phase began
    at: float  # wall clock
    kind: str
    target: str


@dataclass(frozen=True)
class Records:
    """What the run left in Postgres: every committed row and its business record's commit
    time, the outbox at the end, every handler run, and the effects of both kinds of handler."""

    enqueued: list[Enqueued]
    committed_at: dict[int, float]
    finals: dict[int, Final]
    runs: list[Run]
    run_family: dict[int, str]  # row id -> family, for rows that ran
    plain_effects: list[tuple[int, int, bool]]  # (row, attempt, maybe_applied), own connection
    txn_effects: list[tuple[int, int, bool]]  # committed with the settle
    transactional: frozenset[str]  # families whose handler is transactional


@dataclass(frozen=True)
class Facts:
    """What the orchestrator knows: the configuration, the faults it injected and the kills
    among them, processes that died on their own, and when things happened."""

    config: dict[str, Any]
    logdir: str
    fault_kinds: tuple[str, ...]
    faults: list[Fault]
    kills: list[Kill]
    crashes: list[str]
    planned: int
    enqueued: int  # as the producer counted its commits
    producer_retries: int
    first_commit_at: float
    live_at_last_fault: int
    stranded_by_last_fault: int
    settled_at: float | None
    now: float
    # 2 * max(lease, heartbeat_timeout) over the run's families (checks.settle_limit)
    settle_limit: float
    # rows not settled when the settle limit passed, each its state as state_value() wrote
    # it (at most SHOWN_ROWS), and how many there were
    unsettled: list[dict[str, str]] = field(default_factory=list)
    unsettled_count: int = 0

    @property
    def lease(self) -> float:
        return float(self.config["lease"])


@dataclass
class Report:
    """Everything the run measured; ``verdicts`` are the checks that decide the exit status."""

    config: dict[str, Any]
    logdir: str
    faults: dict[str, int]
    fault_kinds: list[str]  # the kinds this run was to inject
    fault_log: list[dict[str, Any]]
    rows: int
    rows_by_family: dict[str, int]
    fates: dict[str, dict[str, int]]
    lost: int
    lost_rows: list[int]
    parked_lost_rows: list[int]
    parked_other: list[dict[str, Any]]
    dup_txn: dict[str, Any]
    dup_other: dict[str, Any]
    reruns_of_one_claim: list[tuple[int, int]]
    phantom_rows: list[int]
    cap_breaches: list[dict[str, Any]]
    cap_peak: dict[str, int]
    order_breaches: list[dict[str, Any]]
    ordered_overlaps: list[dict[str, Any]]
    runs: int
    runs_closed_by_kill: int
    runs_without_end: int
    killed_runs_by_family: dict[str, int]
    maybe_applied_by_family: dict[str, int]
    maybe_applied_runs: int
    told_to_stop_runs: int
    gave_up_by_family: dict[str, int]  # polite runs that returned early on ctx.is_cancelled
    soft_limit_runs: int  # runs a prefork worker interrupted with SoftTimeLimitExceeded
    delivered_unfinished: list[dict[str, Any]]  # rows delivered by an attempt that gave up
    delivered_unfinished_count: int
    delivered_unfinished_by_how: dict[str, int]
    latency: dict[str, float]  # commit to the end of the first successful run, seconds
    slowest: list[str]  # the rows that took longest from commit to success, with their runs
    last_to_settle: list[str]  # the last successful runs, timed from the last fault
    producer_retries: int
    crashes: list[str]
    live_at_last_fault: int
    stranded_by_last_fault: int  # handler runs in progress that the last fault killed
    last_fault: str
    settle_seconds: float | None
    settle_limit: float
    unsettled_count: int  # rows not settled when the settle limit passed
    unsettled_rows: list[dict[str, str]]  # their states (the first SHOWN_ROWS), runs attached
    elapsed: float
    throughput: float
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def jsonable(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def succeeded_rows(rec: Records) -> set[int]:
    """Rows whose work was done: a committed effect for transactional handlers, a successful
    run for the others."""
    family_of = {e.row_id: e.family for e in rec.enqueued}
    done = {row for row, _, _ in rec.txn_effects}
    return done | {
        r.row_id for r in rec.runs if r.ok and family_of.get(r.row_id) not in rec.transactional
    }


def assess(rec: Records, facts: Facts) -> Report:
    succeeded = succeeded_rows(rec)
    fates = checks.classify(rec.enqueued, rec.finals, succeeded)
    spans = checks.close_runs(rec.runs, facts.kills, facts.lease)
    by_row: dict[int, list[Run]] = defaultdict(list)
    for r in rec.runs:
        by_row[r.row_id].append(r)
    report = Report(
        config=facts.config,
        logdir=facts.logdir,
        faults=dict(Counter(f.kind for f in facts.faults)),
        fault_kinds=list(facts.fault_kinds),
        fault_log=[asdict(f) for f in facts.faults],
        rows=len(rec.enqueued),
        rows_by_family=dict(Counter(e.family for e in rec.enqueued)),
        **_fates(rec, fates),
        **_effects(rec),
        **_overlaps(rec, spans, succeeded),
        **_runs(rec, spans),
        **_timing(rec, facts, fates, by_row),
        producer_retries=facts.producer_retries,
        crashes=facts.crashes,
        live_at_last_fault=facts.live_at_last_fault,
        stranded_by_last_fault=facts.stranded_by_last_fault,
        settle_limit=facts.settle_limit,
        unsettled_count=facts.unsettled_count,
        unsettled_rows=[
            {**state, "runs": _runs_of(state, rec, by_row, facts)} for state in facts.unsettled
        ],
    )
    report.verdicts = verdicts(report, rec, facts, fates)
    return report


def _runs_of(
    state: Mapping[str, str], rec: Records, by_row: Mapping[int, list[Run]], facts: Facts
) -> str:
    """The handler runs of an unsettled row, timed from the last fault."""
    try:
        row = int(state.get("id", ""))
    except ValueError:
        return "-"
    runs = by_row.get(row, [])
    if not runs:
        return "never ran"
    origin = facts.faults[-1].at if facts.faults else 0.0
    return history(row, rec.run_family.get(row, "?"), runs, origin, facts.kills)


def _fates(rec: Records, fates: dict[int, Fate]) -> dict[str, Any]:
    by_family: dict[str, Counter[str]] = defaultdict(Counter)
    for e in rec.enqueued:
        by_family[e.family][fates[e.row_id].value] += 1
    lost = sorted(r for r, f in fates.items() if f in checks.LOST)
    return {
        "fates": {fam: dict(c) for fam, c in sorted(by_family.items())},
        "lost": len(lost),
        "lost_rows": lost[:50],
        "parked_lost_rows": sorted(r for r, f in fates.items() if f is Fate.PARKED_LOST),
        "parked_other": [
            {"row_id": r, "family": rec.finals[r].family, "last_error": rec.finals[r].last_error}
            for r, f in sorted(fates.items())
            if f is Fate.PARKED_OTHER
        ][:50],
    }


def _effects(rec: Records) -> dict[str, Any]:
    known = {e.row_id for e in rec.enqueued}
    ran = {r.row_id for r in rec.runs} | {row for row, _, _ in rec.txn_effects}
    return {
        "dup_txn": asdict(checks.duplicate_effects(rec.txn_effects)),
        "dup_other": asdict(checks.duplicate_effects(rec.plain_effects)),
        "reruns_of_one_claim": checks.reruns_of_one_claim(rec.runs)[:50],
        "phantom_rows": sorted(ran - known)[:50],
    }


def _overlaps(rec: Records, spans: list[Span], succeeded: set[int]) -> dict[str, Any]:
    ordered = [s for s in spans if rec.run_family.get(s.row_id) == "ordered"]
    lines: dict[str, list[int]] = defaultdict(list)
    for e in sorted(rec.enqueued, key=lambda e: e.row_id):
        if e.family == "ordered" and e.actor is not None:
            lines[e.actor].append(e.row_id)
    breaches: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    for family in CAPPED:
        capped = [s for s in spans if rec.run_family.get(s.row_id) == family]
        breaches += [
            {"family": family, **asdict(b)} for b in checks.concurrency_breaches(capped, CAP)
        ]
        peaks[family] = max(checks.peak_concurrency(capped).values(), default=0)
    return {
        "cap_breaches": breaches[:50],
        "cap_peak": peaks,
        "order_breaches": [asdict(b) for b in checks.order_breaches(lines, ordered, succeeded)][
            :50
        ],
        "ordered_overlaps": [asdict(b) for b in checks.concurrency_breaches(ordered, 1)][:50],
    }


def delivered_rows(rec: Records) -> set[int]:
    """Rows the outbox settled as delivered: deleted, or kept as done."""
    out = set()
    for e in rec.enqueued:
        final = rec.finals.get(e.row_id)
        if (final is None and not e.keeps_done) or (final is not None and final.done):
            out.add(e.row_id)
    return out


def _runs(rec: Records, spans: list[Span]) -> dict[str, Any]:
    killed = Counter(
        rec.run_family.get(s.row_id, "?") for s in spans if s.closed is checks.Closed.KILLED
    )
    told = Counter(rec.run_family.get(r.row_id, "?") for r in rec.runs if r.maybe_applied)
    gave_up = Counter(rec.run_family.get(r.row_id, "?") for r in rec.runs if r.gave_up)
    unfinished = checks.delivered_unfinished(rec.runs, delivered_rows(rec))
    return {
        "runs": len(rec.runs),
        "runs_closed_by_kill": sum(killed.values()),
        "runs_without_end": sum(1 for s in spans if s.closed is checks.Closed.ASSUMED),
        "killed_runs_by_family": dict(killed),
        "maybe_applied_by_family": dict(told),
        "maybe_applied_runs": sum(told.values()),
        "told_to_stop_runs": sum(1 for r in rec.runs if r.told_to_stop),
        "gave_up_by_family": dict(gave_up),
        "soft_limit_runs": sum(1 for r in rec.runs if r.error == "SoftTimeLimitExceeded"),
        "delivered_unfinished": [
            {"family": rec.run_family.get(u.row_id, "?"), **asdict(u)} for u in unfinished[:50]
        ],
        "delivered_unfinished_count": len(unfinished),
        "delivered_unfinished_by_how": dict(Counter(u.how for u in unfinished)),
    }


def _timing(
    rec: Records, facts: Facts, fates: dict[int, Fate], by_row: dict[int, list[Run]]
) -> dict[str, Any]:
    family_of = {e.row_id: e.family for e in rec.enqueued}
    first_ok: dict[int, float] = {}
    last_ok: dict[int, float] = {}
    for r in rec.runs:
        if r.ok and r.ended is not None and r.row_id in rec.committed_at:
            first_ok[r.row_id] = min(first_ok.get(r.row_id, r.ended), r.ended)
            last_ok[r.row_id] = max(last_ok.get(r.row_id, r.ended), r.ended)
    slowest = sorted(first_ok, key=lambda row: rec.committed_at[row] - first_ok[row])[:5]
    last = facts.faults[-1] if facts.faults else None
    origin = last.at if last else 0.0
    final = max(last_ok.values(), default=0.0)
    settle = None if facts.settled_at is None or last is None else facts.settled_at - last.at
    elapsed = (facts.settled_at or facts.now) - facts.first_commit_at
    settled_rows = sum(1 for f in fates.values() if f not in checks.LOST)
    return {
        "latency": checks.percentiles(
            [end - rec.committed_at[row] for row, end in first_ok.items()], (50, 99, 100)
        ),
        "slowest": [
            history(row, family_of[row], by_row[row], rec.committed_at[row], facts.kills)
            for row in slowest
        ],
        "last_to_settle": [
            history(row, family_of[row], by_row[row], origin, facts.kills)
            for row, end in last_ok.items()
            if end == final
        ][:3],
        "last_fault": f"{last.kind} {last.target} at {last.t:.1f} s" if last else "-",
        "settle_seconds": None if settle is None else round(settle, 2),
        "elapsed": round(elapsed, 1),
        "throughput": round(settled_rows / max(elapsed, 1e-9), 1),
    }


def verdicts(report: Report, rec: Records, facts: Facts, fates: dict[int, Fate]) -> list[Verdict]:
    dup_txn, dup_other = report.dup_txn, report.dup_other
    cancelled = sum(1 for f in fates.values() if f is Fate.CANCELLED)
    # a lost row is counted once, as lost, whatever it was planned to do
    permanent_unparked = [
        e.row_id
        for e in rec.enqueued
        if e.permanent
        and fates[e.row_id] not in (Fate.PARKED_EXPECTED, Fate.PARKED_LOST)
        and fates[e.row_id] not in checks.LOST
    ]
    missing = [k for k in facts.fault_kinds if k not in report.faults]
    settle = report.settle_seconds
    committed = len(rec.enqueued)
    return [
        Verdict(
            "rows enqueued = rows committed",
            f"{facts.enqueued} = {committed}",
            "equal",
            facts.enqueued == committed == facts.planned,
        ),
        Verdict("rows lost", str(report.lost), "0", report.lost == 0),
        Verdict(
            "duplicate effects, transactional", str(dup_txn["extra"]), "0", dup_txn["extra"] == 0
        ),
        Verdict(
            "duplicate effects, other handlers",
            f"{dup_other['extra']} ({dup_other['flagged']} flagged maybe_applied)",
            "only flagged",
            dup_other["unflagged"] == 0,
        ),
        Verdict(
            "one claim run twice",
            str(len(report.reruns_of_one_claim)),
            "0",
            not report.reruns_of_one_claim,
        ),
        Verdict(
            "effects of rows never committed",
            str(len(report.phantom_rows)),
            "0",
            not report.phantom_rows,
        ),
        Verdict(
            "delivered by an attempt that gave up on is_cancelled, failed or never returned",
            _unfinished_value(report),
            "0",
            report.delivered_unfinished_count == 0,
        ),
        Verdict(
            f"cap breaches (cap {CAP}: {', '.join(CAPPED)})",
            f"{len(report.cap_breaches)} (peak {max(report.cap_peak.values(), default=0)})",
            "0",
            not report.cap_breaches,
        ),
        Verdict(
            "order breaches, ordered family",
            str(len(report.order_breaches)),
            "0",
            not report.order_breaches,
        ),
        Verdict(
            "ordered actor running twice at once",
            str(len(report.ordered_overlaps)),
            "0",
            not report.ordered_overlaps,
        ),
        Verdict(
            "parked for an unplanned reason",
            str(len(report.parked_other)),
            "0",
            not report.parked_other,
        ),
        Verdict(
            "planned PermanentFailure rows not parked",
            str(len(permanent_unparked)),
            "0",
            not permanent_unparked,
        ),
        Verdict("cancelled rows (none requested)", str(cancelled), "0", cancelled == 0),
        Verdict(
            "settle after the last fault",
            _settle_value(settle, report.unsettled_count, facts.settle_limit),
            f"<= {facts.settle_limit:g} s (2 x max(lease, heartbeat_timeout))",
            report.unsettled_count == 0 and checks.within(settle, facts.settle_limit),
        ),
        Verdict("every fault kind injected", ", ".join(missing) or "all", "all", not missing),
    ]


def _unfinished_value(report: Report) -> str:
    hows = Counter(report.delivered_unfinished_by_how)
    detail = ", ".join(f"{n} {how.split(' (')[0]}" for how, n in hows.most_common())
    return f"{report.delivered_unfinished_count}" + (f" ({detail})" if detail else "")


def _settle_value(settle: float | None, unsettled: int, limit: float) -> str:
    if not unsettled:
        return "never" if settle is None else f"{settle:.1f} s"
    late = "never settled" if settle is None else f"all settled after {settle:.1f} s"
    return f"{unsettled} rows unsettled at +{limit:g} s ({late})"


def state_value(column: str, value: object, origin: float) -> str:
    """One column of a row's printed state, from the row as JSON (``to_jsonb``, so an
    'infinity' due time survives): times as the wall clock and the offset from the last fault
    (what the settle limit counts from), NULL as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (column.endswith("_at") or column == "due_since"):
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            return value  # infinity
        clock = when.astimezone().strftime("%H:%M:%S.%f")[:-3]
        return f"{clock} ({when.timestamp() - origin:+.1f} s)"
    return str(value)


def state_of(row: Mapping[str, object], origin: float) -> dict[str, str]:
    """Every column of an outbox row (but payload and trace context) as printed."""
    return {k: state_value(k, v, origin) for k, v in row.items() if k not in STATE_OMITTED}


def row_state(state: Mapping[str, str]) -> str:
    """``column=value`` for every column of an unsettled row: the leading columns first."""
    keys = [k for k in STATE_COLUMNS if k in state]
    keys += [k for k in state if k not in STATE_COLUMNS and k not in STATE_OMITTED and k != "runs"]
    return " ".join(f"{k}={state[k]}" for k in keys)


def unsettled_lines(rows: list[dict[str, str]], count: int) -> list[str]:
    """The printed states of the rows that did not settle in time, their runs below each."""
    if not count:
        return []
    lines = [f"rows not settled within the settle limit: {count}"]
    for state in rows[:SHOWN_ROWS]:
        lines.append("  " + row_state(state))
        if "runs" in state:
            lines.append("    runs: " + state["runs"])
    if count > min(len(rows), SHOWN_ROWS):
        lines.append(f"  ... and {count - min(len(rows), SHOWN_ROWS)} more")
    return lines


def history(row: int, family: str, runs: list[Run], origin: float, kills: list[Kill]) -> str:
    """One row's runs, timed from ``origin`` (its commit, or the last fault): when each began
    and ended (or was killed), its attempt and whether it was told maybe_applied."""
    parts = []
    for r in sorted(runs, key=lambda r: r.started):
        [span] = checks.close_runs([r], kills, lease=0.0)
        ended = "gave up on is_cancelled" if r.gave_up else "ok" if r.ok else "failed"
        if r.error and not r.ok:
            ended += f" ({r.error})"
        how = {checks.Closed.RECORDED: ended}.get(span.closed, span.closed)
        flag = " maybe_applied" if r.maybe_applied else ""
        parts.append(
            f"attempt {r.attempt}{flag}: {r.started - origin:+.1f}..{span.end - origin:+.1f} s"
            f" {how}"
        )
    return f"row {row} ({family}): " + "; ".join(parts)


def render(report: Report) -> str:
    """The figures a person reads: what ran, what became of the rows, the checks, and the
    timing with the stories behind the slowest rows."""
    cfg = report.config
    lines = [
        "",
        f"chaos: {report.rows} rows over {cfg['duration']:.0f} s, {cfg['workers']} workers +"
        f" {cfg['claimers']} claimers, lease {cfg['lease']:.0f} s, seed {cfg['seed']};"
        f" logs in {report.logdir}",
        "faults: "
        + ", ".join(f"{k} {n}" for k, n in sorted(report.faults.items(), key=lambda kv: -kv[1]))
        + f" ({sum(report.faults.values())} in all)",
        "",
    ]
    rows = [
        {"family": fam, "rows": report.rows_by_family.get(fam, 0), **report.fates.get(fam, {})}
        for fam in FAMILIES
    ]
    total: Counter[str] = Counter()
    for fam_fates in report.fates.values():
        total.update(fam_fates)
    rows.append({"family": "all", "rows": report.rows, **total})
    used = ["family", "rows"] + [f.value for f in Fate if any(r.get(f.value) for r in rows)]
    lines += [table([{c: r.get(c, 0) for c in used} for r in rows], used), ""]
    lines.append(
        table(
            [
                {"check": v.name, "value": v.value, "limit": v.limit, "ok": "yes" if v.ok else "NO"}
                for v in report.verdicts
            ],
            ["check", "value", "limit", "ok"],
        )
    )
    lines += [
        "",
        f"throughput: {report.throughput} rows/s settled ({report.rows} rows in"
        f" {report.elapsed:.0f} s, first commit to settled); {report.runs} handler runs,"
        f" {report.maybe_applied_runs} with maybe_applied, {report.told_to_stop_runs} told to"
        f" stop, {report.runs_closed_by_kill} ended by a kill, {report.runs_without_end} without"
        " an end or a kill",
        f"polite runs that gave up on is_cancelled by family: {report.gave_up_by_family};"
        f" runs interrupted by SoftTimeLimitExceeded: {report.soft_limit_runs}; cap peaks:"
        f" {report.cap_peak}",
        "commit to first successful run: "
        + ", ".join(f"p{k} {v:.2f} s" for k, v in report.latency.items()),
        f"runs killed mid-run by family: {report.killed_runs_by_family}; runs told"
        f" maybe_applied by family: {report.maybe_applied_by_family}",
        "last to settle (times from the last fault): " + " | ".join(report.last_to_settle),
        "slowest from commit to success: " + " | ".join(report.slowest[:3]),
        f"last fault: {report.last_fault}; {report.live_at_last_fault} rows live then,"
        f" {report.stranded_by_last_fault} handler runs killed by it;"
        f" producer retried {report.producer_retries} transactions; processes that exited on"
        f" their own (restarted): {len(report.crashes)}",
    ]
    if report.parked_lost_rows:
        lines.append(
            f"parked after {len(report.parked_lost_rows)} rows' attempts kept ending without an"
            f" outcome (max_lost): {report.parked_lost_rows[:20]}"
        )
    for name, items in (
        ("delivered by an unfinished attempt", report.delivered_unfinished),
        ("lost rows", report.lost_rows),
        ("parked for other reasons", report.parked_other),
        ("cap breaches", report.cap_breaches),
        ("order breaches", report.order_breaches),
        ("ordered overlaps", report.ordered_overlaps),
        ("one claim run twice", report.reruns_of_one_claim),
        ("crashes", report.crashes),
    ):
        if items:
            lines.append(f"{name}: {items[:10]}")
    lines += unsettled_lines(report.unsettled_rows, report.unsettled_count)
    lines.append(f"\nchaos: {'OK' if report.ok else 'FAILED'}")
    return "\n".join(lines)
