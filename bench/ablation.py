"""``python -m bench.ablation``: what each mechanism on the hot path buys, measured by switching
it off, one at a time, against plain Celery in the same run.

Every configuration runs the same scenarios on a fresh worker (``-c 2``, or two worker nodes
with ``-c 1`` each): a backlog of the default family, 100 actors uncapped and at cap 4, a
family pinned to one row per message, then commit-to-start latency at paced rates. Rounds are
interleaved (every configuration once per round, in a rotated order); the table gives each
figure's median over the rounds with their range.

The switches are monkeypatches applied by ``bench/app.py`` in the worker from the
``OUTBOX_BENCH_OFF`` environment variable (``switch_off``): the package has no flag for them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import procs as P
from bench.report import percentile

# name -> what switching it off does (the mechanism it removes)
SWITCHES: dict[str, str] = {
    "template": "publish through apply_async per message (no templated, pre-serialized publish)",
    "deferred": "settle each success at once (no deferred-settles thread, no settle carried "
    "by the next start, no held cap releases)",
    "unflushed": "starts wait for their WAL flush (flushed_starts=True)",
    "deferral": "claim when the queue already holds work for every consumer (no claim deferral)",
    "youngslot": "a capped start always renews its slot in Redis (no young-claim skip)",
    "ownprocess": "the commit listener runs as threads of the worker's main process",
    "published": "a claim's messages are not added to the cached queue length",
}
NODES = "outbox-bench:nodes"  # hash: worker node -> rows its handlers ran


def switch_off(names: Iterable[str], dispatcher: Any) -> None:
    """Apply the switches in the worker's process (called by bench/app.py at import)."""
    names = set(names)
    unknown = names - set(SWITCHES)
    if unknown:
        raise SystemExit(f"OUTBOX_BENCH_OFF: unknown switches {sorted(unknown)}")
    if "template" in names:
        from outbox_dispatch.claim import publisher

        setattr(publisher.Publisher, "_needs_celery_path", lambda self, queue: True)  # noqa: B010
    if "deferred" in names:
        from outbox_dispatch.worker import delivery

        original = delivery.Delivery.deliver_message

        def no_defer(self: Any, args: Any, **kw: Any) -> Any:
            kw["defer"] = False
            return original(self, args, **kw)

        setattr(delivery.Delivery, "deliver_message", no_defer)  # noqa: B010
    if "deferral" in names:
        from outbox_dispatch.claim import claimer

        setattr(claimer, "claim_can_wait", lambda *a, **k: False)  # noqa: B010
    if "published" in names:
        from outbox_dispatch.claim import queues

        setattr(queues.QueueProbe, "published", lambda self, family, messages: None)  # noqa: B010
    if "ownprocess" in names:
        from outbox_dispatch.claim import listener

        def start_here(self: Any) -> None:
            self.threads = self.make()
            for each in self.threads:
                each.start()

        def stop_here(self: Any) -> None:
            for each in getattr(self, "threads", []):
                each.stop()

        setattr(listener.ListenerProcess, "start", start_here)  # noqa: B010
        setattr(listener.ListenerProcess, "stop", stop_here)  # noqa: B010
    if "youngslot" in names:
        from outbox_dispatch.worker import slots

        setattr(slots, "slot_surely_left", lambda *a, **k: None)  # noqa: B010


@dataclass
class Figures:
    config: str
    round: int
    rows_per_s: dict[str, float] = field(default_factory=dict)  # scenario -> rows/s
    p50_ms: dict[int, float] = field(default_factory=dict)  # pace -> ms
    p99_ms: dict[int, float] = field(default_factory=dict)
    node_share: dict[str, float] = field(default_factory=dict)  # node -> share of the backlog


SCENARIOS = (
    ("default", "bench.default", 0),
    ("uncapped", "bench.uncapped", 100),
    ("capped", "bench.capped", 100),
    ("batch1", "bench.single", 0),
)


def _two_nodes(config: str) -> bool:
    """'two-nodes' (every mechanism on) or 'two-nodes:<switch>' (that one off), on two nodes."""
    return config.partition(":")[0] == "two-nodes"


def _outbox_procs(config: str, logdir: Path, concurrency: int) -> list[P.Proc]:
    off = "" if config in ("all", "two-nodes") else config.removeprefix("two-nodes:")
    env = {"OUTBOX_BENCH_OFF": off}
    beat = P.celery("beat", "--loglevel", "WARNING", "-s", str(logdir / f"beat-{config}"))
    beat.env = env
    if _two_nodes(config):
        nodes = [
            P.celery(
                "worker",
                "-P",
                "prefork",
                "-c",
                "1",
                "-n",
                f"{name}@%h",
                "--loglevel",
                "WARNING",
                env={**env, "OUTBOX_BENCH_NODE": name},
            )
            for name in ("node-a", "node-b")
        ]
        return [*nodes, beat]
    worker = P.celery(
        "worker", "-P", "prefork", "-c", str(concurrency), "--loglevel", "WARNING", env=env
    )
    return [worker, beat]


def _latency(
    r: redis.Redis,
    procs: list[Any],
    label: str,
    send: Callable[[float], None],
    pace: int,
    seconds: float,
) -> tuple[float, float]:
    time.sleep(1.0)
    r.delete(P.LATENCIES)
    r.set(P.COUNTER, 0)
    t0 = time.monotonic()
    n = P.pace_loop(send, pace, seconds)
    P.wait_count(r, n, f"{label} @ {pace}/s", 300, procs, t0=t0)
    values = sorted(float(v) * 1000 for v in r.lrange(P.LATENCIES, 0, -1))
    return round(percentile(values, 0.5), 2), round(percentile(values, 0.99), 2)


def run_outbox(
    config: str, rnd: int, r: redis.Redis, logdir: Path, o: argparse.Namespace
) -> Figures:
    import psycopg

    from bench import app as bench
    from bench.run import outbox_producer

    fig = Figures(config, rnd)
    procs = P.start(_outbox_procs(config, logdir, o.concurrency), logdir, f"{config}-{rnd}")
    try:
        P.warm_up(P.System(config, "outbox", [], outbox_producer("bench.default")), r, procs)
        for name, command, actors in SCENARIOS:
            if _two_nodes(config) and name != "default":
                continue
            rows = o.rows if name != "batch1" else o.rows // 2
            P.clean_redis(r)
            P.vacuum(bench.DATABASE_URL)
            r.set(P.COUNTER, 0)
            t0 = time.monotonic()
            outbox_producer(command, actors, tx_rows=1000 if actors else rows)(rows)
            t1 = P.wait_count(r, rows, f"{config} {name}", 600, procs, t0=t0)
            fig.rows_per_s[name] = round(rows / (t1 - t0), 1)
            if _two_nodes(config):
                counts = {_text(k): int(v) for k, v in r.hgetall(NODES).items()}
                total = sum(counts.values()) or 1
                fig.node_share = {k: round(v / total, 3) for k, v in sorted(counts.items())}
            P.say(f"  {config} {name}: {fig.rows_per_s[name]:,.0f} rows/s {fig.node_share or ''}")
        with psycopg.connect(bench.DATABASE_URL) as conn:

            def one(sent: float) -> None:
                with conn.transaction():
                    bench.dispatcher.enqueue(conn, "bench.latency", {"sent": sent})

            for pace in o.paces:
                P.vacuum(bench.DATABASE_URL)
                fig.p50_ms[pace], fig.p99_ms[pace] = _latency(
                    r, procs, config, one, pace, o.seconds
                )
                P.say(f"  {config} @ {pace}/s: p50 {fig.p50_ms[pace]} ms, p99 {fig.p99_ms[pace]}")
    finally:
        P.stop(procs)
    return fig


def run_celery(rnd: int, r: redis.Redis, logdir: Path, o: argparse.Namespace) -> Figures:
    from bench import app as bench

    fig = Figures("celery", rnd)
    worker = P.celery("worker", "-P", "prefork", "-c", str(o.concurrency), "--loglevel", "WARNING")
    procs = P.start([worker], logdir, f"celery-{rnd}")

    def plain(n: int) -> None:
        with bench.app.producer_or_acquire() as producer:
            for i in range(n):
                bench.noop.apply_async((i,), producer=producer)

    try:
        P.warm_up(P.System("celery", "celery", [], plain), r, procs)
        t0 = time.monotonic()
        plain(o.rows)
        t1 = P.wait_count(r, o.rows, "celery", 600, procs, t0=t0)
        fig.rows_per_s["default"] = round(o.rows / (t1 - t0), 1)
        P.say(f"  celery: {fig.rows_per_s['default']:,.0f} rows/s")
        with bench.app.producer_or_acquire() as producer:

            def one(sent: float) -> None:
                bench.plain_latency.apply_async((sent,), producer=producer)

            for pace in o.paces:
                fig.p50_ms[pace], fig.p99_ms[pace] = _latency(
                    r, procs, "celery", one, pace, o.seconds
                )
                P.say(f"  celery @ {pace}/s: p50 {fig.p50_ms[pace]} ms, p99 {fig.p99_ms[pace]}")
    finally:
        P.stop(procs)
    return fig


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _median_range(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(figures: list[Figures], paces: Sequence[int]) -> str:
    """Per configuration: each goal's ratio, median over rounds with the range."""
    celery = {f.round: f for f in figures if f.config == "celery"}
    configs = list(dict.fromkeys(f.config for f in figures if f.config != "celery"))
    one_node = {f.round: f for f in figures if f.config == "all"}
    head = ["config", "default/celery", "cap4/uncapped", "batch1 rows/s"]
    for pace in paces:
        head += [f"p50@{pace} /celery", f"p99@{pace} /celery"]
    head += ["2 nodes/1 node", "node shares"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for config in configs:
        rows = [f for f in figures if f.config == config and f.round in celery]
        cells = [config]

        def ratio(
            get: Callable[[Figures], float | None],
            base: Callable[[Figures], float | None],
            rows: list[Figures] = rows,
        ) -> str:
            out = []
            for f in rows:
                a, b = get(f), base(f)
                if a and b:
                    out.append(a / b)
            return _median_range(out)

        def rate(name: str) -> Callable[[Figures], float | None]:
            return lambda x: x.rows_per_s.get(name)

        def celery_of(get: Callable[[Figures], float | None]) -> Callable[[Figures], float | None]:
            return lambda x: get(celery[x.round])

        def p50(pace: int) -> Callable[[Figures], float | None]:
            return lambda x: x.p50_ms.get(pace)

        def p99(pace: int) -> Callable[[Figures], float | None]:
            return lambda x: x.p99_ms.get(pace)

        def one_node_rate(f: Figures) -> float | None:
            return one_node[f.round].rows_per_s.get("default") if f.round in one_node else None

        cells.append(ratio(rate("default"), celery_of(rate("default"))))
        cells.append(ratio(rate("capped"), rate("uncapped")))
        cells.append(
            _median_range([f.rows_per_s["batch1"] for f in rows if "batch1" in f.rows_per_s])
        )
        for pace in paces:
            cells.append(ratio(p50(pace), celery_of(p50(pace))))
            cells.append(ratio(p99(pace), celery_of(p99(pace))))
        if _two_nodes(config):
            cells.append(ratio(rate("default"), one_node_rate))
            shares = [min(f.node_share.values()) for f in rows if f.node_share]
            cells.append(f"smaller share {_median_range(shares)}")
        else:
            cells += ["", ""]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__)
    p.add_argument(
        "--configs",
        default=",".join(["all", *SWITCHES, "two-nodes"]),
        help="'all' (every mechanism on), a switch name (that one off), 'two-nodes', "
        "'two-nodes:<switch>' (two nodes with that one off)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--paces", default="50,200")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds each rate is offered")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--out", default="", help="file for the figures as JSON")
    p.add_argument("--table", default="", help="print the table of a JSON file and exit")
    o = p.parse_args(argv)
    o.paces = [int(x) for x in o.paces.split(",") if x]
    if o.table:
        loaded = [Figures(**d) for d in json.loads(Path(o.table).read_text())]
        for f in loaded:
            f.p50_ms = {int(k): v for k, v in f.p50_ms.items()}
            f.p99_ms = {int(k): v for k, v in f.p99_ms.items()}
        print(table(loaded, o.paces))
        return 0
    from bench import app as bench

    configs = [c for c in o.configs.split(",") if c]
    r = redis.Redis.from_url(bench.REDIS_URL)
    from outbox_dispatch.store.migrations import migrate

    migrate(bench.DATABASE_URL, bench.SCHEMA)
    logdir = Path(tempfile.mkdtemp(prefix="outbox-ablation-"))
    P.say(f"ablation: {configs}, {o.rounds} rounds; logs in {logdir}")
    figures: list[Figures] = []
    for rnd in range(o.rounds):
        P.say(f"round {rnd + 1} of {o.rounds}")
        order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
        figures.append(run_celery(rnd, r, logdir, o))
        for config in order:
            P.clean_redis(r)
            figures.append(run_outbox(config, rnd, r, logdir, o))
        if o.out:
            Path(o.out).write_text(json.dumps([asdict(f) for f in figures], indent=1))
    print(table(figures, o.paces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
