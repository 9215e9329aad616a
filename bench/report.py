"""The benchmark's results and their tables: pure code (no I/O), so it is unit-tested.

Results are plain dataclasses so ``--json`` and the plot read the same figures the tables show.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from outbox_dispatch.core.tables import table

# the scenarios the goals compare (issue 14); the outbox families are in bench/app.py
PLAIN = "celery delay()"
DEFAULT = "outbox default family"
PER_ROW = "outbox batch=1"
UNCAPPED = "100 actors, uncapped"
CAPPED = "100 actors, cap 4"
UNCAPPED_1 = "100 actors, uncapped, batch=1"
CAPPED_1 = "100 actors, cap 4, batch=1"
PROCRASTINATE = "procrastinate"
DCO = "django-celery-outbox"
PEERS = (PROCRASTINATE, DCO)


@dataclass
class Throughput:
    """``rows`` no-op deliveries, timed from the first enqueue (or publish) to the last run."""

    scenario: str
    system: str
    rows: int
    seconds: float
    produce_seconds: float = 0.0  # the producer's part of ``seconds``
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per row by process group
    runs: list[float] = field(default_factory=list)  # rows/s of each round (0: it failed)

    @property
    def per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Latency:
    """Commit (or publish) to handler start, at a paced offered rate."""

    scenario: str
    system: str
    pace: int
    rows: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    p50_runs: list[float] = field(default_factory=list)  # each round's, when repeated
    p99_runs: list[float] = field(default_factory=list)


@dataclass
class RssSample:
    at_rows: int
    total_kb: int
    per_process_kb: dict[int, int]


@dataclass
class RssGrowth:
    """Worker processes' resident memory after warm-up and after the last delivery."""

    family: str
    rows: int
    warm: RssSample
    end: RssSample
    seconds: float
    samples: list[RssSample] = field(default_factory=list)  # every tenth of the run

    @property
    def growth_pct(self) -> float:
        return growth_pct(self.warm.total_kb, self.end.total_kb)

    @property
    def max_process_growth_pct(self) -> float:
        """The worst single process: a leak in one pool child hides in the total."""
        common = set(self.warm.per_process_kb) & set(self.end.per_process_kb)
        return max(
            (growth_pct(self.warm.per_process_kb[p], self.end.per_process_kb[p]) for p in common),
            default=0.0,
        )


@dataclass
class Backpressure:
    """Many due rows, slow handlers, a family with ``max_in_flight`` and a short lease."""

    rows: int
    handler_ms: float
    max_in_flight: int
    lease: float
    seconds: float
    delivered_rows: int  # distinct rows whose handler ran
    deliveries: int  # handler runs
    twice: int  # rows whose handler ran more than once
    later_attempts: int  # handler runs with attempt > 1 (a lease ran out on a started row)
    reclaims: int  # claims beyond one per row (a lease ran out before the message ran)
    max_in_flight_seen: int  # the claimer's own count, sampled
    max_queue_seen: int  # messages waiting in the family's Celery queue, sampled

    @property
    def per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ClaimCostRow:
    stored_not_due: int
    median_ms: float


@dataclass
class Results:
    machine: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    throughput: list[Throughput] = field(default_factory=list)
    latency: list[Latency] = field(default_factory=list)
    claim_cost: list[ClaimCostRow] = field(default_factory=list)
    rss: list[RssGrowth] = field(default_factory=list)
    backpressure: list[Backpressure] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["throughput"] = [
            asdict(t) | {"per_second": round(t.per_second, 1)} for t in self.throughput
        ]
        out["rss"] = [
            asdict(r)
            | {
                "growth_pct": round(r.growth_pct, 2),
                "max_process_growth_pct": round(r.max_process_growth_pct, 2),
            }
            for r in self.rss
        ]
        out["backpressure"] = [
            asdict(b) | {"per_second": round(b.per_second, 1)} for b in self.backpressure
        ]
        out["peer_ratios"] = peer_ratios(self.throughput)
        out["goals"] = goals(self)
        return out


def results_from_json(data: dict[str, Any]) -> Results:
    """A run's ``bench.json`` back into Results, to redraw its plot or tables (``--replot``)."""

    def sample(d: dict[str, Any]) -> RssSample:
        per = {int(k): int(v) for k, v in d["per_process_kb"].items()}
        return RssSample(int(d["at_rows"]), int(d["total_kb"]), per)

    derived = {"per_second", "growth_pct", "max_process_growth_pct"}

    def plain(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in derived}

    return Results(
        machine=dict(data.get("machine", {})),
        settings=dict(data.get("settings", {})),
        throughput=[Throughput(**plain(t)) for t in data.get("throughput", [])],
        latency=[Latency(**x) for x in data.get("latency", [])],
        claim_cost=[ClaimCostRow(**c) for c in data.get("claim_cost", [])],
        rss=[
            RssGrowth(
                g["family"],
                g["rows"],
                sample(g["warm"]),
                sample(g["end"]),
                g["seconds"],
                [sample(x) for x in g.get("samples", [])],
            )
            for g in data.get("rss", [])
        ],
        backpressure=[Backpressure(**plain(b)) for b in data.get("backpressure", [])],
        failures=list(data.get("failures", [])),
    )


def growth_pct(before: float, after: float) -> float:
    return (after - before) / before * 100.0 if before > 0 else 0.0


def median_throughput(rounds: list[Throughput | None]) -> Throughput | None:
    """One scenario's figure over repeated rounds: the round with the median rows/s (its CPU
    too), carrying every round's rows/s in ``runs`` (0 for a round that failed), so that
    ratios can be taken round by round, between systems measured minutes apart at most."""
    ran = [t for t in rounds if t is not None]
    if not ran:
        return None
    ordered = sorted(ran, key=lambda t: t.per_second)
    middle = ordered[(len(ordered) - 1) // 2]
    runs = [round(t.per_second, 1) if t is not None else 0.0 for t in rounds]
    return replace(middle, runs=runs)


def median_latency(rounds: list[Latency]) -> Latency | None:
    """One scenario's latency at one rate over repeated rounds: the median p50 and p99 of
    the rounds (each its own window, 30 s by default), and the largest max."""
    if not rounds:
        return None
    p50s, p99s = [x.p50_ms for x in rounds], [x.p99_ms for x in rounds]
    return replace(
        rounds[0],
        rows=sum(x.rows for x in rounds),
        p50_ms=round(statistics.median(p50s), 1),
        p99_ms=round(statistics.median(p99s), 1),
        max_ms=max(x.max_ms for x in rounds),
        p50_runs=p50s if len(rounds) > 1 else [],
        p99_runs=p99s if len(rounds) > 1 else [],
    )


def round_ratios(ours: Throughput, theirs: Throughput) -> list[float]:
    """``ours / theirs`` in each round both ran; one ratio of their figures when not
    repeated (or from a bench.json written before rounds)."""
    if ours.runs and len(ours.runs) == len(theirs.runs):
        return [a / b for a, b in zip(ours.runs, theirs.runs, strict=True) if a > 0 and b > 0]
    return [ours.per_second / theirs.per_second] if theirs.per_second > 0 else []


def median_round_ratio(ours: Throughput, theirs: Throughput) -> float | None:
    """The median of the rounds' ratios (None: none to take)."""
    ratios = round_ratios(ours, theirs)
    return statistics.median(ratios) if ratios else None


def median_ratio(ours: Throughput, theirs: Throughput) -> str:
    """The median of the rounds' ratios as the tables show it (``-``: none to take)."""
    value = median_round_ratio(ours, theirs)
    return "-" if value is None else ratio(value, 1.0)


def ratio(ours: float, theirs: float) -> str:
    """``ours / theirs`` as shown in the tables: ``2.50x``, or ``-`` when nothing to divide."""
    return f"{ours / theirs:.2f}x" if ours > 0 and theirs > 0 else "-"


def _by_scenario(figures: list[Throughput]) -> dict[str, Throughput]:
    return {f.scenario: f for f in figures}


def throughput_table(figures: list[Throughput], baseline: str = PLAIN) -> str:
    base = _by_scenario(figures).get(baseline)
    rows = [
        {
            "scenario": f.scenario,
            "system": f.system,
            "rows": f.rows,
            "seconds": f"{f.seconds:.2f}",
            "producing s": f"{f.produce_seconds:.2f}",
            "rows/s": f"{f.per_second:,.0f}",
            "vs plain Celery": median_ratio(f, base) if base else "-",
        }
        for f in figures
    ]
    columns = ["scenario", "system", "rows", "seconds", "producing s", "rows/s"]
    if any(len(f.runs) > 1 for f in figures):  # repeated: every round's rows/s, in order
        for row, f in zip(rows, figures, strict=True):
            row["rounds"] = " ".join(f"{r:,.0f}" for r in f.runs)
        columns.append("rounds")
    return table(rows, [*columns, "vs plain Celery"])


def cpu_table(figures: list[Throughput]) -> str:
    """CPU milliseconds per row by process group (see cpu.py)."""
    groups = ["worker", "postgres", "redis", "driver", "total"]
    rows = [
        {"scenario": f.scenario, "system": f.system, **{g: f"{f.cpu_ms[g]:.2f}" for g in groups}}
        for f in figures
        if f.cpu_ms
    ]
    return table(rows, ["scenario", "system", *groups])


def peer_ratios(figures: list[Throughput]) -> list[dict[str, Any]]:
    """Ours / theirs for every peer that ran: the default family (sized per claim) and one
    row per message (batch=1, the like-for-like)."""
    by = _by_scenario(figures)
    out: list[dict[str, Any]] = []
    for f in figures:
        if f.system not in PEERS:
            continue
        row: dict[str, Any] = {"peer": f.system, "peer rows/s": round(f.per_second, 1)}
        for label, scenario in (("default", DEFAULT), ("batch=1", PER_ROW)):
            ours = by.get(scenario)
            value = median_round_ratio(ours, f) if ours else None
            row[f"{label} ours/theirs"] = None if value is None else round(value, 2)
        out.append(row)
    return out


def peer_table(figures: list[Throughput]) -> str:
    rows = [
        {
            **r,
            "peer rows/s": f"{r['peer rows/s']:,.0f}",
            "default ours/theirs": _x(r["default ours/theirs"]),
            "batch=1 ours/theirs": _x(r["batch=1 ours/theirs"]),
        }
        for r in peer_ratios(figures)
    ]
    return table(rows, ["peer", "peer rows/s", "default ours/theirs", "batch=1 ours/theirs"])


def goals(results: Results) -> list[dict[str, Any]]:
    """Issue 14's goals, each with its target, what this run measured and whether it is met
    (None: the scenarios it needs did not run)."""
    by = _by_scenario(results.throughput)
    out: list[dict[str, Any]] = []

    def throughput(goal: str, ours: str, theirs: str, target: float) -> None:
        a, b = by.get(ours), by.get(theirs)
        ratios = round_ratios(a, b) if a and b else []
        value = statistics.median(ratios) if ratios else None
        met = None if value is None else value >= target
        row = _goal(goal, f">= {target:.1f}x", value, met, "x")
        if len(ratios) > 1:  # the median of the rounds' ratios, and their range
            row["measured"] += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        out.append(row)

    throughput("1. default family vs plain Celery delay()", DEFAULT, PLAIN, 2.0)
    throughput("1. default family vs django-celery-outbox", DEFAULT, DCO, 2.0)
    throughput("2. batch=1 vs django-celery-outbox", PER_ROW, DCO, 1.0)
    throughput("2. cap 4 over 100 actors vs django-celery-outbox", CAPPED, DCO, 1.0)
    throughput("2. cap 4 vs uncapped (100 actors)", CAPPED, UNCAPPED, 0.8)
    throughput("2. cap 4 vs uncapped (100 actors), batch=1", CAPPED_1, UNCAPPED_1, 0.8)
    lat = {(x.scenario, x.pace): x for x in results.latency}
    for pace in (50,):
        ours, theirs = lat.get((DEFAULT, pace)), lat.get((PROCRASTINATE, pace))
        for q in ("p50", "p99"):
            a = getattr(ours, f"{q}_ms") if ours else None
            b = getattr(theirs, f"{q}_ms") if theirs else None
            met = None if a is None or b is None else a <= b
            target = f"<= procrastinate ({b} ms)" if b is not None else "<= procrastinate"
            out.append(_goal(f"3. commit to start {q} at {pace} rows/s", target, a, met, " ms"))
    at200 = lat.get((DEFAULT, 200))
    p99 = at200.p99_ms if at200 else None
    out.append(
        _goal(
            "3. commit to start p99 at 200 rows/s",
            "<= 10 ms",
            p99,
            None if p99 is None else p99 <= 10,
            " ms",
        )
    )
    if len(results.claim_cost) > 1 and results.claim_cost[0].median_ms > 0:
        r = results.claim_cost[1].median_ms / results.claim_cost[0].median_ms
        out.append(_goal("4. claim next to 1M rows not due", "<= 1.5x", r, r <= 1.5, "x"))
    for g in results.rss:
        out.append(
            _goal(
                f"4. worker RSS over {g.rows:,} deliveries",
                "<= +10 %",
                g.growth_pct,
                g.growth_pct <= 10,
                " %",
            )
        )
    for bp in results.backpressure:
        out.append(
            _goal(
                f"4. backpressure, {bp.rows:,} rows: delivered twice",
                "0",
                bp.twice,
                bp.twice == 0,
                "",
            )
        )
    return out


def _goal(
    goal: str, target: str, value: float | None, met: bool | None, unit: str
) -> dict[str, Any]:
    shown = (
        "-"
        if value is None
        else (f"{value:.2f}{unit}" if unit in ("x", " %") else f"{value:g}{unit}")
    )
    return {"goal": goal, "target": target, "measured": shown, "met": met}


def goals_table(results: Results) -> str:
    rows = [{**g, "met": {True: "yes", False: "NO", None: "-"}[g["met"]]} for g in goals(results)]
    return table(rows, ["goal", "target", "measured", "met"])


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def latency_table(latency: list[Latency]) -> str:
    rows = [asdict(x) | {"scenario": f"{x.scenario} @ {x.pace}/s"} for x in latency]
    columns = ["scenario", "system", "rows", "p50_ms", "p99_ms", "max_ms"]
    if any(x.p50_runs for x in latency):  # repeated: each round's p50 / p99
        for row, x in zip(rows, latency, strict=True):
            row["rounds p50 / p99"] = " ".join(
                f"{a:g}/{b:g}" for a, b in zip(x.p50_runs, x.p99_runs, strict=True)
            )
        columns.append("rounds p50 / p99")
    return table(rows, columns)


def rss_table(rss: list[RssGrowth]) -> str:
    rows = [
        {
            "family": r.family,
            "deliveries": f"{r.rows:,}",
            "warm-up at": f"{r.warm.at_rows:,}",
            "RSS warm MiB": f"{r.warm.total_kb / 1024:.1f}",
            "RSS end MiB": f"{r.end.total_kb / 1024:.1f}",
            "growth": f"{r.growth_pct:+.1f} %",
            "worst process": f"{r.max_process_growth_pct:+.1f} %",
            "processes": len(r.end.per_process_kb),
        }
        for r in rss
    ]
    columns = ["family", "deliveries", "warm-up at", "RSS warm MiB", "RSS end MiB", "growth"]
    return table(rows, [*columns, "worst process", "processes"])


def backpressure_table(bp: list[Backpressure]) -> str:
    rows = [
        {
            "rows": f"{b.rows:,}",
            "handler": f"{b.handler_ms:g} ms",
            "max_in_flight": b.max_in_flight,
            "lease": f"{b.lease:g} s",
            "rows/s": f"{b.per_second:,.0f}",
            "delivered": f"{b.delivered_rows:,}",
            "twice": b.twice,
            "attempt > 1": b.later_attempts,
            "re-claims": b.reclaims,
            "max in flight seen": b.max_in_flight_seen,
            "max queued": b.max_queue_seen,
        }
        for b in bp
    ]
    columns = ["rows", "handler", "max_in_flight", "lease", "rows/s", "delivered", "twice"]
    return table(rows, [*columns, "attempt > 1", "re-claims", "max in flight seen", "max queued"])


def claim_cost_table(costs: list[ClaimCostRow]) -> str:
    return table([asdict(c) for c in costs], ["stored_not_due", "median_ms"])


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def machine_lines(machine: dict[str, str]) -> str:
    return "\n".join(f"  {k}: {v}" for k, v in machine.items())


def render(results: Results) -> str:
    """Every table of a run, in the order the README shows them."""
    parts: list[str] = []
    if results.machine:
        parts += ["machine:", machine_lines(results.machine), ""]
    if any(g["met"] is not None for g in goals(results)):
        parts += ["goals (issue 14), this run:", goals_table(results), ""]
    if results.throughput:
        parts += ["throughput (no-op deliveries, first enqueue to last run):"]
        parts += [throughput_table(results.throughput), ""]
        if any(f.cpu_ms for f in results.throughput):
            parts += ["CPU per row, ms, by process (worker = the system's own processes):"]
            parts += [cpu_table(results.throughput), ""]
        if peer_ratios(results.throughput):
            parts += ["against peers (ours / theirs, same Postgres, broker and work):"]
            parts += [peer_table(results.throughput), ""]
    if results.latency:
        parts += ["commit (or publish) -> handler start, each rate offered for a fixed time:"]
        parts += [latency_table(results.latency), ""]
    if results.claim_cost:
        parts += ["claim of 500 due rows (median):", claim_cost_table(results.claim_cost)]
        if len(results.claim_cost) > 1 and results.claim_cost[0].median_ms > 0:
            r = results.claim_cost[1].median_ms / results.claim_cost[0].median_ms
            parts += [f"ratio with / without: {r:.2f}x"]
        parts += [""]
    if results.rss:
        parts += ["worker RSS growth (all worker processes, VmRSS):"]
        parts += [rss_table(results.rss), ""]
    if results.backpressure:
        parts += ["backpressure (one worker, rows due at once):"]
        parts += [backpressure_table(results.backpressure), ""]
    if results.failures:
        parts += ["FAILED:", *(f"  {f}" for f in results.failures), ""]
    return "\n".join(parts).rstrip() + "\n"
