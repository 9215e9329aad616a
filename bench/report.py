"""The benchmark's results and their tables: pure code (no I/O), so it is unit-tested.

Results are plain dataclasses so ``--json`` and the plot read the same figures the tables show.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from outbox_dispatch.tables import table

# what each system's per-row throughput is compared with, and the targets (ours/theirs)
PER_ROW = "outbox per-row"
BATCHED = "outbox batched (50/msg)"
PEER_TARGETS = {"procrastinate": 3.0, "django-celery-outbox": 1.5}


@dataclass
class Throughput:
    """``rows`` no-op deliveries, timed from the first enqueue (or publish) to the last run."""

    scenario: str
    system: str
    rows: int
    seconds: float
    produce_seconds: float = 0.0  # the producer's part of ``seconds``
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per row by process group

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


def ratio(ours: float, theirs: float) -> str:
    """``ours / theirs`` as shown in the tables: ``2.50x``, or ``-`` when nothing to divide."""
    return f"{ours / theirs:.2f}x" if ours > 0 and theirs > 0 else "-"


def _by_scenario(figures: list[Throughput]) -> dict[str, Throughput]:
    return {f.scenario: f for f in figures}


def throughput_table(figures: list[Throughput], baseline: str = "celery delay()") -> str:
    base = _by_scenario(figures).get(baseline)
    rows = [
        {
            "scenario": f.scenario,
            "system": f.system,
            "rows": f.rows,
            "seconds": f"{f.seconds:.2f}",
            "producing s": f"{f.produce_seconds:.2f}",
            "rows/s": f"{f.per_second:,.0f}",
            "vs plain Celery": ratio(f.per_second, base.per_second) if base else "-",
        }
        for f in figures
    ]
    columns = ["scenario", "system", "rows", "seconds", "producing s", "rows/s"]
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
    """Ours / theirs for every peer that ran: per-row (the like-for-like, one row per message)
    and batched; ``meets`` compares the per-row ratio with the issue's target."""
    by = _by_scenario(figures)
    ours = by.get(PER_ROW)
    batched = by.get(BATCHED)
    out: list[dict[str, Any]] = []
    for f in figures:
        if f.system not in PEER_TARGETS:
            continue
        target = PEER_TARGETS[f.system]
        per_row = ours.per_second / f.per_second if ours and f.per_second > 0 else None
        out.append(
            {
                "peer": f.system,
                "peer rows/s": round(f.per_second, 1),
                "per-row ours/theirs": round(per_row, 2) if per_row is not None else None,
                "batched ours/theirs": (
                    round(batched.per_second / f.per_second, 2)
                    if batched and f.per_second > 0
                    else None
                ),
                "target": target,
                "meets": None if per_row is None else per_row >= target,
            }
        )
    return out


def peer_table(figures: list[Throughput]) -> str:
    rows = [
        {
            **r,
            "peer rows/s": f"{r['peer rows/s']:,.0f}",
            "per-row ours/theirs": _x(r["per-row ours/theirs"]),
            "batched ours/theirs": _x(r["batched ours/theirs"]),
            "target": f">= {r['target']:.1f}x",
            "meets": {True: "yes", False: "NO", None: "-"}[r["meets"]],
        }
        for r in peer_ratios(figures)
    ]
    columns = ["peer", "peer rows/s", "per-row ours/theirs", "batched ours/theirs", "target"]
    return table(rows, [*columns, "meets"])


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def latency_table(latency: list[Latency]) -> str:
    rows = [asdict(x) | {"scenario": f"{x.scenario} @ {x.pace}/s"} for x in latency]
    return table(rows, ["scenario", "system", "rows", "p50_ms", "p99_ms", "max_ms"])


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
