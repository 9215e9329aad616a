"""The benchmark's PNG: throughput per system and scenario, and latency p50/p99 per rate.

matplotlib is imported here only (Agg backend, no display), from the benchmark's own venv;
without it the run still prints its tables and says that it drew no plot.
"""

from __future__ import annotations

from pathlib import Path

from bench.procs import say
from bench.report import Results

COLORS = {
    "celery": "#7f7f7f",
    "outbox": "#1f77b4",
    "procrastinate": "#ff7f0e",
    "django-celery-outbox": "#2ca02c",
}


def _footer(results: Results) -> str:
    m = results.machine
    parts = [
        f"{m.get('cpu', '?')}, {m.get('memory', '?')}, {m.get('date', '')}, "
        f"load at start {m.get('load at start', '?')}"
    ]
    parts.append(f"worker: {results.settings.get('worker', '?')}")
    for g in results.rss:
        parts.append(
            f"RSS {g.family} over {g.rows:,} deliveries: {g.growth_pct:+.1f} % "
            f"(from {g.warm.at_rows:,})"
        )
    for b in results.backpressure:
        parts.append(
            f"backpressure {b.rows:,} rows x {b.handler_ms:g} ms: {b.twice} twice, "
            f"max in flight {b.max_in_flight_seen}/{b.max_in_flight}"
        )
    return " | ".join(parts)


def plot(results: Results, path: str | Path) -> bool:
    """Write the PNG; False (and a line saying why) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("plot: matplotlib is not installed here (scripts/bench installs it); no PNG")
        return False

    panels = [p for p in (results.throughput, results.latency) if p]
    if not panels:
        say("plot: no throughput or latency figures; no PNG")
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.8), squeeze=False)
    col = 0
    if results.throughput:
        ax = axes[0][col]
        col += 1
        figs = results.throughput[::-1]  # first scenario on top
        names = [f.scenario for f in figs]
        values = [f.per_second for f in figs]
        # repeated rounds: a whisker from the slowest to the fastest round
        spans = [[r for r in f.runs if r > 0] or [f.per_second] for f in figs]
        whiskers = [
            [v - min(s) for v, s in zip(values, spans, strict=True)],
            [max(s) - v for v, s in zip(values, spans, strict=True)],
        ]
        bars = ax.barh(
            names,
            values,
            color=[COLORS.get(f.system, "#999999") for f in figs],
            xerr=whiskers if any(len(s) > 1 for s in spans) else None,
            error_kw={"ecolor": "#333333", "capsize": 2, "lw": 0.8},
        )
        for bar, v, span in zip(bars, values, spans, strict=True):
            ax.text(
                max(span),  # past the whisker
                bar.get_y() + bar.get_height() / 2,
                f" {v:,.0f}",
                va="center",
                fontsize=8,
            )
        rows = results.throughput[0].rows
        rounds = max(len(s) for s in spans)
        shown = f"median of {rounds} rounds, " if rounds > 1 else ""
        ax.set_title(f"throughput, {rows:,} no-op rows ({shown}rows/s, higher is better)")
        ax.set_xlabel("rows/s")
        ax.set_xlim(0, max(max(s) for s in spans) * 1.18 if values else 1)
        ax.grid(axis="x", alpha=0.3)
    if results.latency:
        ax = axes[0][col]
        lat = results.latency  # by rate, then in the order the systems ran
        labels = [f"{x.scenario} @ {x.pace}/s" for x in lat][::-1]
        p50 = [max(x.p50_ms, 0.1) for x in lat][::-1]
        p99 = [max(x.p99_ms, 0.1) for x in lat][::-1]
        ys = list(range(len(lat)))
        h = 0.38
        for offset, values, label, color in (
            (h / 2, p50, "p50", "#1f77b4"),
            (-h / 2, p99, "p99", "#d62728"),
        ):
            bars = ax.barh([y + offset for y in ys], values, height=h, label=label, color=color)
            for bar, v in zip(bars, values, strict=True):
                ax.text(
                    bar.get_width(),
                    bar.get_y() + bar.get_height() / 2,
                    f" {v:,.1f}" if v < 100 else f" {v:,.0f}",
                    va="center",
                    fontsize=7,
                )
        ax.set_yticks(ys)
        ax.set_yticklabels(labels)
        ax.set_xscale("log")
        ax.set_xlim(min([*p50, *p99]) / 1.5, max([*p50, *p99]) * 3)
        ax.set_xlabel("ms, log scale")
        ax.set_title("commit (or publish) -> handler start (lower is better)")
        ax.legend(loc="upper right")  # the slowest bars are at the bottom
        ax.grid(axis="x", alpha=0.3, which="both")
    fig.text(0.01, 0.01, _footer(results), fontsize=7, color="#444444", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    say(f"plot: wrote {out}")
    return True
