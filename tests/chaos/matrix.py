"""The fault and pressure matrix (``scripts/chaos --matrix``): one steady load, run clean once
(the baseline) and then once per fault, each cell on a fresh schema of one private Postgres
cluster and Redis, through real worker and claimer processes (``run.Chaos``, whose checks
decide each cell's verdict).

The cells:

- ``postgres_restart``: ``pg_ctl stop -m fast`` and start (every session ends, down 1 s).
- ``pg_backend_kill``: ``pg_terminate_backend`` of every client session (the workers' pools,
  the listener, the producer's): the server stays up.
- ``pool_exhaustion``: the workers connect as a role without superuser rights, and the cluster
  is restarted so that role may open a quarter more sessions than the workers held at their
  peak in the baseline run (``max_connections`` is that plus the slots reserved for
  superusers, which the harness's own sessions use); at the fault more worker processes start,
  each with pools of its own: connections past the limit are refused.
- ``repeated_kills``: kill -9 of a delivery worker (its process group) every few seconds for
  the fault's length; each comes back 0.5-2 s later.
- ``idle_in_tx``: a session opens a repeatable-read transaction, reads the outbox (so it holds
  a snapshot) and sits idle in it for ``--idle-for`` seconds while rows flow: no row version
  deleted after it began can be vacuumed away until it ends.
- ``active_readers``: sessions that read the outbox in a loop (counts by family, the newest
  rows) for the fault's length.
- ``redis_restart_lost``: Redis killed -9 and started empty (queues, unacked messages, cap
  slots gone).
- ``clock_step_back``: the wall clock of every worker and claimer process steps back (a
  minute by default) and stays there (``clock.py``: an ``LD_PRELOAD`` shim; the monotonic
  clock is untouched, as in a real step). Run records take Postgres' clock in this cell.

Each cell reports its completion rate against the baseline (rows settled by the time the
baseline had settled all of its own: its last commit plus its drain time, as a share of the
rows, over the baseline's share), rows lost, rows run twice without ``maybe_applied``, cap
and order breaches, the time from the fault (its end, for faults that last) until every row
committed by then was settled, and the p99 and max from commit to a row's first start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import psycopg

from . import checks
from .checks import Fate
from .clock import ClockStep
from .report import Fault, Records, Report
from .run import Chaos, ChaosConfig, Producer
from .services import APP_ROLE, Services

CELLS = (
    "postgres_restart",
    "pg_backend_kill",
    "pool_exhaustion",
    "repeated_kills",
    "idle_in_tx",
    "active_readers",
    "redis_restart_lost",
    "clock_step_back",
)
BASELINE = "baseline"
LASTING = frozenset({"repeated_kills", "idle_in_tx", "active_readers"})
# the report's verdicts the matrix replaces: its own settle check, and the fault kinds of a
# chaos run (a cell injects one)
REPLACED = ("settle after the last fault", "every fault kind injected")
SETTLED = frozenset(Fate) - checks.LOST
# pool_exhaustion: the workers' role may open this share of the baseline's peak sessions, so
# the fleet fits and the worker processes that join at the fault do not
HEADROOM = 1.25
SLACK = 1.0  # s added to the baseline's drain time in the completion window: one run's jitter
# worker log lines at ERROR that a cell's faults should not cause: every ERROR line but the
# parking of rows planned to fail for good
PLANNED_ERROR = "planned to fail for good"


@dataclass(frozen=True)
class MatrixConfig:
    cells: tuple[str, ...] = CELLS
    rate: float = 25.0  # rows/s committed
    load: float = 40.0  # seconds of load (idle_in_tx: at least until 5 s after its hold)
    fault_at: float = 15.0  # seconds into the load the fault (or a lasting one) begins
    fault_for: float = 20.0  # length of repeated_kills and active_readers
    idle_for: float = 20.0  # idle_in_tx's hold (the issue's: 300)
    kill_every: float = 3.0
    readers: int = 4
    clock_step: float = 60.0  # seconds the clock steps back
    extra_workers: int = 3  # pool_exhaustion: worker processes started at the fault
    # pool_exhaustion: sessions the workers' role may open (max_connections less the slots
    # reserved for superusers); 0: HEADROOM times the baseline's peak of the workers' sessions
    max_connections: int = 0
    workers: int = 3
    claimers: int = 2
    pools: str = "threads,prefork"
    lease: float = 10.0
    heartbeat_timeout: float = 3.0
    chunk: int = 5  # rows per producer transaction
    # s past the settle limit to keep waiting, so a late row is told from a lost one (a row
    # still unsettled then is counted lost)
    late_wait: float = 60.0
    seed: int = 1
    baseline: bool = True
    logdir: str = ""


@dataclass
class CellResult:
    cell: str
    fault: str
    faults: int  # fault events injected (each kill of repeated_kills is one)
    rows: int
    lost: int
    unflagged_duplicates: int  # transactional extra effects plus unflagged other ones
    flagged_duplicates: int
    cap_breaches: int
    order_breaches: int  # order breaches plus an ordered actor running twice at once
    settle_limit: float
    fault_to_settled: float | None  # None: a row committed by the fault's end never settled
    settled_after_load: float | None  # from the later of the fault's end and the last commit
    start_p50: float | None
    start_p99: float | None
    start_max: float | None
    tail: float | None  # last commit to every row settled
    peak_sessions: int
    error_lines: int  # ERROR lines in the workers' and claimers' logs, planned parks aside
    completion: float | None = None  # % of the baseline's, filled in by the matrix
    ok: bool = False
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    logdir: str = ""
    settle_times: dict[int, float] = field(default_factory=dict, repr=False)
    committed_at: dict[int, float] = field(default_factory=dict, repr=False)

    def jsonable(self) -> dict[str, Any]:
        out = asdict(self)
        del out["settle_times"], out["committed_at"]
        return out


def chaos_config(mc: MatrixConfig, cell: str) -> ChaosConfig:
    load = max(mc.load, mc.fault_at + mc.idle_for + 5) if cell == "idle_in_tx" else mc.load
    return ChaosConfig(
        rows=max(1, int(mc.rate * load)),
        duration=load,
        workers=mc.workers,
        claimers=mc.claimers,
        seed=mc.seed,
        lease=mc.lease,
        heartbeat_timeout=mc.heartbeat_timeout,
        pools=mc.pools,
        schema=f"m_{cell}",
        record_clock="postgres" if cell == "clock_step_back" else "local",
        chunk=mc.chunk,
    )


class CellRun(Chaos):
    """One cell: the chaos run's load, fleet and checks, with this cell's fault alone."""

    def __init__(
        self, mc: MatrixConfig, cell: str, services: Services, logdir: Path, out: TextIO
    ) -> None:
        self.cell = cell
        self.mc = mc
        self.clock = ClockStep(logdir) if cell == "clock_step_back" else None
        env = self.clock.env() if self.clock else None
        super().__init__(chaos_config(mc, cell), services, logdir, out, fleet_env=env)
        self.kinds = []
        self.peak_sessions = 0
        self.notes: list[str] = []
        self.fault_end = 0.0  # wall clock of the fault's (last) moment
        self.settled_at: float | None = None
        self.producer_done = 0.0
        self._stop = threading.Event()
        # the fleet works as a runtime role without superuser rights; run records, the
        # producer and the orchestrator as the superuser, whose reserved slots keep them
        # connected when the pool_exhaustion cell runs the outbox out of connections
        pg = services.postgres
        self.fleet.settings = replace(self.settings, database_url=pg.app_url, record_url=pg.url)

    def _prepare(self) -> None:
        super()._prepare()
        self.services.postgres.grant_app(self.settings.schema)

    # -- the fault -----------------------------------------------------------------------------

    def _fault(self, what: str, target: str) -> None:
        fault = Fault(round(time.monotonic() - self.t0, 2), time.time(), self.cell, target)
        self.faults.append(fault)
        self.fault_end = fault.at
        self._say(f"[{fault.t:6.1f}s] {self.cell}: {what} {target}".rstrip())

    def _inject_faults(self, producer: Producer) -> None:
        sampler = threading.Thread(target=self._sample_sessions, daemon=True)
        sampler.start()
        try:
            self._wait(producer, self.mc.fault_at)
            if self.cell != BASELINE:
                getattr(self, f"_cell_{self.cell}")(producer)
            while producer.is_alive():
                self._keep_fleet()
                self._progress(producer)
                time.sleep(0.1)
        finally:
            self._stop.set()
            sampler.join(5)

    def _wait(self, producer: Producer, until: float) -> None:
        while time.monotonic() - self.t0 < until:
            self._keep_fleet()
            self._progress(producer)
            time.sleep(0.05)

    def _sample_sessions(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(psycopg.Error):
                sessions = self.services.postgres.client_sessions(APP_ROLE)
                self.peak_sessions = max(self.peak_sessions, sessions)

    def _cell_postgres_restart(self, producer: Producer) -> None:
        how = self.services.postgres.fast_restart(down=1.0)
        self._fault("", f"{how}, down 1 s")

    def _cell_pg_backend_kill(self, producer: Producer) -> None:
        self._fault("", f"{self.services.postgres.terminate_backends()} sessions terminated")

    def _cell_pool_exhaustion(self, producer: Producer) -> None:
        extra = [self.fleet.add(f"x{i}") for i in range(self.mc.extra_workers)]
        for m in extra:
            self.fleet.start(m)
        pg = self.services.postgres
        limit = pg.max_connections - pg.reserved_connections
        self._fault("", f"{len(extra)} more worker processes, {limit} sessions for the workers")

    def _cell_repeated_kills(self, producer: Producer) -> None:
        until = self.mc.fault_at + self.mc.fault_for
        while (now := time.monotonic() - self.t0) < until:
            victims = self.fleet.up("worker", settled_for=1.0)
            if victims:
                victim = self.rng.choice(victims)
                back = self.rng.uniform(0.5, 2.0)
                kill = self.fleet.kill(victim, back)
                self.kills.append(kill)
                self._fault("kill -9", f"{victim.name} (pgid {kill.pgid}, back in {back:.1f} s)")
            self._wait(producer, min(until, now + self.mc.kill_every))

    def _cell_idle_in_tx(self, producer: Producer) -> None:
        url = self.settings.database_url
        with psycopg.connect(url, connect_timeout=5) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.execute(f"SELECT count(*) FROM {self.settings.table('outbox')}")
            self._fault("", f"a session idle in transaction for {self.mc.idle_for:g} s: begins")
            self._wait(producer, self.mc.fault_at + self.mc.idle_for)
            conn.rollback()
        self._fault("", "the idle transaction ends")

    def _cell_active_readers(self, producer: Producer) -> None:
        outbox = self.settings.table("outbox")
        reads = [0] * self.mc.readers
        stop = threading.Event()

        def read(i: int) -> None:
            conn: psycopg.Connection[Any] | None = None
            while not stop.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(
                            self.settings.database_url, autocommit=True, connect_timeout=3
                        )
                    conn.execute(f"SELECT family, count(*) FROM {outbox} GROUP BY family")
                    conn.execute(f"SELECT * FROM {outbox} ORDER BY id DESC LIMIT 100").fetchall()
                    reads[i] += 2
                except psycopg.Error:
                    conn = None
                stop.wait(0.02)
            if conn is not None:
                conn.close()

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(reads))]
        for t in threads:
            t.start()
        self._fault("", f"{len(threads)} sessions reading the outbox in a loop: begin")
        self._wait(producer, self.mc.fault_at + self.mc.fault_for)
        stop.set()
        for t in threads:
            t.join(10)
        self._fault("", f"the readers stop after {sum(reads)} reads")

    def _cell_redis_restart_lost(self, producer: Producer) -> None:
        self.services.redis.restart(down=1.0)
        self._fault("", "killed -9 and started empty, down 1 s")

    def _cell_clock_step_back(self, producer: Producer) -> None:
        assert self.clock is not None
        self.clock.set(-self.mc.clock_step)
        self._fault("", f"every worker's and claimer's wall clock {self.mc.clock_step:g} s back")

    # -- settling ------------------------------------------------------------------------------

    def _settle(self, producer: Producer) -> float | None:
        """Every row settled: the time it happened, or None. The limit counts from the later
        of the fault's end and the last commit; the state of rows still unsettled then is
        taken, and the wait goes on ``late_wait`` more seconds so a late row is told from a
        lost one."""
        producer.join()
        self.producer_done = producer.done_at
        origin = max(self.fault_end, producer.done_at)
        due = origin + self.settle_limit
        snapped = False
        while time.time() < due + self.mc.late_wait:
            self._keep_fleet()
            self._progress(producer)
            if self.monitor.unsettled() == 0:
                self.settled_at = time.time()
                return self.settled_at
            if not snapped and time.time() >= due:
                snapped = self._snapshot(origin)
            time.sleep(0.2)
        self._say(f"not settled {self.settle_limit + self.mc.late_wait:g} s after the load")
        return None


def settle_times(rec: Records) -> dict[int, float]:
    """When each settled row settled: the end of its last run (a kill's moment counts as
    nothing; a row whose last run has no end is not settled by it)."""
    succeeded = {r.row_id for r in rec.runs if r.ok} | {row for row, _, _ in rec.txn_effects}
    fates = checks.classify(rec.enqueued, rec.finals, succeeded)
    last: dict[int, float] = {}
    for r in rec.runs:
        if r.ended is not None and fates.get(r.row_id) in SETTLED:
            last[r.row_id] = max(last.get(r.row_id, r.ended), r.ended)
    return last


def first_starts(rec: Records) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in rec.runs:
        out[r.row_id] = min(out.get(r.row_id, r.started), r.started)
    return out


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def result_of(run: CellRun, report: Report) -> CellResult:
    rec = run.records
    assert rec is not None
    settled = settle_times(rec)
    starts = first_starts(rec)
    latency = sorted(
        starts[row] - rec.committed_at[row] for row in starts if row in rec.committed_at
    )
    pct = checks.percentiles(latency, (50, 99, 100))
    before = [row for row, at in rec.committed_at.items() if at <= run.fault_end]
    fault_to_settled: float | None = None
    if run.cell != BASELINE and before and all(row in settled for row in before):
        fault_to_settled = max(0.0, max(settled[row] for row in before) - run.fault_end)
    tail = None
    if settled and len(settled) == len(rec.enqueued) and rec.committed_at:
        tail = max(settled.values()) - max(rec.committed_at.values())
    origin = max(run.fault_end, run.producer_done)
    after = None if run.settled_at is None else run.settled_at - origin
    verdicts = [v for v in report.verdicts if v.name not in REPLACED]
    failed = [f"{v.name}: {v.value} (limit {v.limit})" for v in verdicts if not v.ok]
    if run.cell != BASELINE and not run.faults:
        failed.append("the fault was not injected")
    if report.unsettled_count or not checks.within(after, run.settle_limit):
        shown = "never" if after is None else f"{after:.1f} s"
        failed.append(
            f"settled after the fault's end or the last commit: {shown} ({report.unsettled_count}"
            f" rows unsettled at +{run.settle_limit:g} s; limit {run.settle_limit:g} s)"
        )
    dup_txn, dup_other = report.dup_txn, report.dup_other
    if report.crashes:
        run.notes.append(
            f"{len(report.crashes)} processes exited on their own and were restarted:"
            f" {'; '.join(report.crashes[:3])}"
        )
    errors = error_lines(run.logdir)
    if errors:
        run.notes.append(f"{len(errors)} ERROR log lines, the first: {errors[0][:300]}")
    return CellResult(
        cell=run.cell,
        fault="; ".join(f"{f.target}" for f in run.faults[:3])
        + (f"; ... {len(run.faults)} in all" if len(run.faults) > 3 else ""),
        faults=len(run.faults),
        rows=report.rows,
        lost=report.lost,
        unflagged_duplicates=int(dup_txn["extra"]) + int(dup_other["unflagged"]),
        flagged_duplicates=int(dup_other["flagged"]),
        cap_breaches=len(report.cap_breaches),
        order_breaches=len(report.order_breaches) + len(report.ordered_overlaps),
        settle_limit=run.settle_limit,
        fault_to_settled=_round(fault_to_settled, 1),
        settled_after_load=_round(after, 1),
        start_p50=pct.get("50"),
        start_p99=pct.get("99"),
        start_max=pct.get("100"),
        tail=_round(tail),
        peak_sessions=run.peak_sessions,
        error_lines=len(errors),
        ok=not failed,
        failed=failed,
        notes=run.notes,
        logdir=str(run.logdir),
        settle_times=settled,
        committed_at=dict(rec.committed_at),
    )


def error_lines(logdir: Path) -> list[str]:
    """ERROR lines the fleet logged (tracebacks' first lines), planned parks aside."""
    out = []
    for log in sorted(logdir.glob("*.log")):
        if log.name in ("postgres.log", "redis.log"):
            continue
        for line in log.read_text(errors="replace").splitlines():
            if ("ERROR/" in line or "CRITICAL/" in line) and PLANNED_ERROR not in line:
                out.append(f"{log.stem}: {line.strip()}")
    return out


def completion(result: CellResult, baseline: CellResult) -> float | None:
    """Rows settled by the time the baseline had settled all of its own (the cell's last
    commit plus the baseline's drain time, and ``SLACK``), as a share of the cell's rows, over
    the same share of the baseline (100 % when it settled everything)."""
    if baseline.tail is None or not result.committed_at or not baseline.committed_at:
        return None

    def share(r: CellResult, window_end: float) -> float:
        done = sum(1 for at in r.settle_times.values() if at <= window_end)
        return done / max(1, len(r.committed_at))

    window = baseline.tail + SLACK
    base = share(baseline, max(baseline.committed_at.values()) + window)
    mine = share(result, max(result.committed_at.values()) + window)
    return round(100.0 * mine / base, 1) if base else None


def reset(services: Services) -> None:
    """Between cells: every key of the previous cell's Redis gone (its fleet is stopped)."""
    client = services.redis.client()
    try:
        client.flushall()
    finally:
        client.close()


def run_cell(
    services: Services,
    mc: MatrixConfig,
    cell: str,
    logdir: Path,
    out: TextIO,
    baseline_peak: int = 0,
) -> CellResult:
    """One cell on the shared services: Redis emptied first; for pool_exhaustion the cluster
    is restarted with its lowered ``max_connections`` and restored after."""
    cell_dir = logdir / cell
    cell_dir.mkdir(parents=True, exist_ok=True)
    reset(services)
    pg = services.postgres
    restore: Callable[[], None] | None = None
    if cell == "pool_exhaustion":
        limit = mc.max_connections or math.ceil(baseline_peak * HEADROOM) or 40
        before = pg.max_connections
        pg.max_connections = limit + pg.reserved_connections
        pg.fast_restart(down=0.2)

        def restore() -> None:
            pg.max_connections = before
            pg.fast_restart(down=0.2)

    out.write(f"\n== {cell}\n")
    try:
        run = CellRun(mc, cell, services, cell_dir, out)
        if cell == "pool_exhaustion":
            run.notes.append(
                f"the workers' role may open {limit} sessions (the baseline's workers held"
                f" {baseline_peak or '?'} at their peak), {mc.extra_workers} more workers at"
                " the fault"
            )
        report = run.run()
    finally:
        if restore is not None:
            restore()
    (cell_dir / "chaos.json").write_text(json.dumps(report.jsonable(), indent=2))
    return result_of(run, report)


def run_matrix(mc: MatrixConfig, out: TextIO) -> list[CellResult]:
    logdir = (
        Path(mc.logdir)
        if mc.logdir
        else Path(tempfile.mkdtemp(prefix=f"outbox-matrix-{time.strftime('%Y%m%d-%H%M%S')}-"))
    )
    logdir.mkdir(parents=True, exist_ok=True)
    results: list[CellResult] = []
    with Services(logdir) as services:
        out.write(
            f"matrix: private postgres on port {services.postgres.port}, redis on port"
            f" {services.redis.port}; logs in {logdir}\n"
        )
        base = None
        if mc.baseline:
            base = run_cell(services, mc, BASELINE, logdir, out)
            results.append(base)
        for cell in mc.cells:
            r = run_cell(services, mc, cell, logdir, out, base.peak_sessions if base else 0)
            if base is not None:
                r.completion = completion(r, base)
            results.append(r)
        if base is not None:
            base.completion = completion(base, base)
    (logdir / "matrix.json").write_text(json.dumps([r.jsonable() for r in results], indent=2))
    return results


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


def table(results: list[CellResult]) -> str:
    head = (
        "| cell | completion | lost | run twice unflagged | cap / order breaches"
        " | fault → all settled | commit → start p99 / max | checks |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    lines = [head]
    for r in results:
        done = "-" if r.completion is None else f"{r.completion:.1f} %"
        settled = "-" if r.cell == BASELINE else _s(r.fault_to_settled)
        lat = f"{r.start_p99 or 0:.2f} / {r.start_max or 0:.2f} s"
        lines.append(
            f"| {r.cell} | {done} | {r.lost} | {r.unflagged_duplicates} |"
            f" {r.cap_breaches} / {r.order_breaches} | {settled} | {lat} |"
            f" {'pass' if r.ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def render(results: list[CellResult], mc: MatrixConfig) -> str:
    lines = [
        "",
        f"fault matrix: {mc.rate:g} rows/s for {mc.load:g} s a cell, {mc.workers} workers"
        f" ({mc.pools}) + {mc.claimers} claimers, lease {mc.lease:g} s, heartbeat timeout"
        f" {mc.heartbeat_timeout:g} s, fault at {mc.fault_at:g} s",
        "",
        table(results),
        "",
    ]
    for r in results:
        lines.append(f"{r.cell}: {r.fault or 'no fault'}; logs in {r.logdir}")
        lines += [f"  note: {n}" for n in r.notes]
        lines += [f"  FAILED {f}" for f in r.failed]
    return "\n".join(lines)


def parse(argv: list[str]) -> tuple[MatrixConfig, bool]:
    d = MatrixConfig()
    p = argparse.ArgumentParser(
        prog="scripts/chaos --matrix",
        description="Run one steady load clean, then once under each fault, and print each"
        " cell's completion rate against the clean run, rows lost, rows run twice without"
        " maybe_applied, cap and order breaches and the time from the fault to every row"
        " settled.",
    )
    p.add_argument("--matrix", action="store_true", help="this mode (required)")
    p.add_argument("--cells", default=",".join(d.cells), help="cells to run, comma-separated (all)")
    p.add_argument("--rate", type=float, default=d.rate, help="rows/s (%(default)s)")
    p.add_argument("--load", type=float, default=d.load, help="s of load a cell (%(default)s)")
    p.add_argument("--fault-at", type=float, default=d.fault_at, help="s (%(default)s)")
    p.add_argument(
        "--fault-for",
        type=float,
        default=d.fault_for,
        help="length of repeated_kills and active_readers, s (%(default)s)",
    )
    p.add_argument(
        "--idle-for",
        type=float,
        default=d.idle_for,
        help="idle_in_tx's hold, s (%(default)s; 300 for five minutes)",
    )
    p.add_argument("--kill-every", type=float, default=d.kill_every, help="s (%(default)s)")
    p.add_argument("--readers", type=int, default=d.readers, help="sessions (%(default)s)")
    p.add_argument("--clock-step", type=float, default=d.clock_step, help="s (%(default)s)")
    p.add_argument(
        "--extra-workers", type=int, default=d.extra_workers, help="pool_exhaustion's (%(default)s)"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="sessions pool_exhaustion lets the workers open (default: 1.25 x the baseline's peak)",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="(%(default)s)")
    p.add_argument("--claimers", type=int, default=d.claimers, help="(%(default)s)")
    p.add_argument("--pools", default=d.pools, help="the workers' pools in turn (%(default)s)")
    p.add_argument("--lease", type=float, default=d.lease, help="s (%(default)s)")
    p.add_argument(
        "--heartbeat-timeout", type=float, default=d.heartbeat_timeout, help="s (%(default)s)"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="the workload (%(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the clean run")
    p.add_argument("--logdir", default="", help="logs and JSON (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="JSON on stdout, progress on stderr")
    a = p.parse_args(argv)
    cells = tuple(c.strip() for c in a.cells.split(",") if c.strip())
    if not cells or any(c not in CELLS for c in cells):
        p.error(f"--cells takes some of {', '.join(CELLS)}")
    if a.rate <= 0 or a.load < 5 or a.lease < 1 or a.workers < 1 or a.claimers < 1:
        p.error("need --rate > 0, --load >= 5, --lease >= 1, --workers >= 1, --claimers >= 1")
    config = MatrixConfig(
        cells=cells,
        rate=a.rate,
        load=a.load,
        fault_at=a.fault_at,
        fault_for=a.fault_for,
        idle_for=a.idle_for,
        kill_every=a.kill_every,
        readers=a.readers,
        clock_step=a.clock_step,
        extra_workers=a.extra_workers,
        max_connections=a.max_connections,
        workers=a.workers,
        claimers=a.claimers,
        pools=a.pools,
        lease=a.lease,
        heartbeat_timeout=a.heartbeat_timeout,
        seed=a.seed,
        baseline=not a.no_baseline,
        logdir=a.logdir,
    )
    return config, a.json


def main(argv: list[str]) -> int:
    mc, as_json = parse(argv)
    out = sys.stderr if as_json else sys.stdout
    results = run_matrix(mc, out)
    if as_json:
        print(json.dumps([r.jsonable() for r in results], indent=2))
    else:
        print(render(results, mc))
    return 0 if all(r.ok for r in results) else 1
