"""Two operator's events, measured on the private services of the chaos run:

- ``scripts/chaos --rolling``: a rolling deploy under load. Three worker nodes (``celery
  worker -n nI@%h``, each consuming the delivery and claim queues and running a commit
  listener; no beat) take a steady load (100 rows/s by default) while each in turn is stopped
  with SIGTERM (Celery's warm shutdown), waited for until it exited, started again and waited
  for until it answers a ping. Reported: commit → start p50 / p99 / max of the rows committed
  during the roll, each node's time to exit, rows lost and rows run twice without
  ``maybe_applied``, with the chaos run's checks.
- ``scripts/chaos --failover``: the commit listener's failover. Two claimers (each runs a
  listener; one holds the schema's listener lock) and two delivery workers take a trickle of
  commits, one row a transaction; the process group of the worker whose listener holds the
  lock is killed -9, a few times. Reported per kill: when another listener held the lock, the
  worst commit → start of the rows committed after the kill, and how long after the kill the
  last row that waited 1 s or more started (commit → start back under 1 s from then on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import psycopg

from . import checks
from .fleet import Member
from .matrix import CellResult, CellRun, MatrixConfig, first_starts, reset, result_of
from .run import Producer
from .services import Services
from .workload import Planned, build, with_role

SLOW = 1.0  # commit -> start the failover figure counts from


def plan_steady(
    rows: int, rng: random.Random, families: tuple[tuple[str, float], ...]
) -> list[Planned]:
    """Short handlers (5-30 ms) that succeed: the load of a deploy, not of a fault test."""
    out: list[Planned] = []
    for seq in range(rows):
        pick, family = rng.random(), families[-1][0]
        for name, share in families:
            if pick < share:
                family = name
                break
            pick -= share
        actor = None
        if family == "capped":
            actor = f"cap{rng.randrange(30)}"
        elif family == "ordered":
            actor = f"line{rng.randrange(50)}"
        out.append(Planned(seq, family, actor, {"seq": seq, "ms": rng.randint(5, 30)}))
    return out


@dataclass
class RollingResult:
    rate: float
    nodes: int
    roll_seconds: float
    exit_seconds: list[float]
    rows_in_roll: int
    p50: float | None
    p99: float | None
    max: float | None
    outside_p50: float | None
    outside_p99: float | None
    cell: CellResult
    notes: list[str] = field(default_factory=list)

    def jsonable(self) -> dict[str, Any]:
        out = asdict(self)
        out["cell"] = self.cell.jsonable()
        return out


class RollingRun(CellRun):
    def __init__(self, mc: MatrixConfig, services: Services, logdir: Path, out: TextIO, nodes: int):
        super().__init__(mc, "rolling", services, logdir, out)
        self.fleet.members = [Member(f"n{i}", "node", "threads") for i in range(nodes)]
        self.exit_seconds: list[float] = []
        self.roll_start = self.roll_end = 0.0

    def plan(self) -> list[Planned]:
        mix = (("intent", 0.6), ("job", 0.2), ("capped", 0.1), ("ordered", 0.1))
        return plan_steady(self.config.rows, random.Random(self.config.seed), mix)

    def _cell_rolling(self, producer: Producer) -> None:
        app, dispatcher = build(with_role(self.settings, "producer"))
        try:
            self.roll_start = time.time()
            for m in list(self.fleet.members):
                took = self.fleet.stop(m, timeout=60)
                self.exit_seconds.append(round(took, 2))
                self._fault("SIGTERM", f"{m.name} exited {took:.1f} s after it")
                self.fleet.start(m)
                self._ready(app, m, producer)
                self._fault("started", f"{m.name} answers again")
            self.roll_end = time.time()
        finally:
            dispatcher.close()
            app.close()

    def _ready(self, app: Any, m: Member, producer: Producer, timeout: float = 60) -> None:
        name = f"{m.name}@{socket.gethostname()}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._progress(producer)
            if app.control.ping(destination=[name], timeout=0.5):
                return
        self.notes.append(f"{name} did not answer a ping within {timeout:g} s")


def _latency(rec: Any, rows: list[int]) -> dict[str, float]:
    starts = first_starts(rec)
    values = [starts[r] - rec.committed_at[r] for r in rows if r in starts]
    return checks.percentiles(values, (50, 99, 100))


def rolling(mc: MatrixConfig, nodes: int, out: TextIO) -> RollingResult:
    logdir = _logdir(mc, "rolling")
    with Services(logdir) as services:
        reset(services)
        out.write(f"rolling deploy: {nodes} nodes, {mc.rate:g} rows/s; logs in {logdir}\n")
        run = RollingRun(mc, services, logdir, out, nodes)
        report = run.run()
        result = result_of(run, report)
    rec = run.records
    assert rec is not None
    during = [r for r, at in rec.committed_at.items() if run.roll_start <= at <= run.roll_end]
    outside = [r for r, at in rec.committed_at.items() if r not in set(during)]
    inside, other = _latency(rec, during), _latency(rec, outside)
    res = RollingResult(
        rate=mc.rate,
        nodes=nodes,
        roll_seconds=round(run.roll_end - run.roll_start, 1),
        exit_seconds=run.exit_seconds,
        rows_in_roll=len(during),
        p50=inside.get("50"),
        p99=inside.get("99"),
        max=inside.get("100"),
        outside_p50=other.get("50"),
        outside_p99=other.get("99"),
        cell=result,
        notes=run.notes,
    )
    (logdir / "rolling.json").write_text(json.dumps(res.jsonable(), indent=2))
    return res


def render_rolling(r: RollingResult) -> str:
    c = r.cell
    lines = [
        "",
        f"rolling deploy: {r.nodes} nodes restarted in turn with SIGTERM at {r.rate:g} rows/s;"
        f" the roll took {r.roll_seconds:.1f} s (exits after SIGTERM: {r.exit_seconds} s)",
        "",
        "| | value |",
        "| --- | ---: |",
        f"| rows committed during the roll | {r.rows_in_roll} of {c.rows} |",
        f"| commit → start p50 / p99 / max during the roll | {r.p50} / {r.p99} / {r.max} s |",
        f"| commit → start p50 / p99 outside it | {r.outside_p50} / {r.outside_p99} s |",
        f"| rows lost | {c.lost} |",
        f"| rows run twice without maybe_applied | {c.unflagged_duplicates} |",
        f"| rows run twice, flagged maybe_applied | {c.flagged_duplicates} |",
        f"| cap / order breaches | {c.cap_breaches} / {c.order_breaches} |",
        f"| checks | {'pass' if c.ok else 'FAIL'} |",
        "",
        f"logs in {c.logdir}",
    ]
    lines += [f"note: {n}" for n in r.notes + c.notes]
    lines += [f"FAILED {f}" for f in c.failed]
    return "\n".join(lines)


# -- the listener's failover ---------------------------------------------------------------


def listener_holder(url: str, schema: str) -> int | None:
    """The Postgres backend holding the schema's listener lock (claim/listener.py)."""
    with psycopg.connect(url, connect_timeout=3) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(%s, 0)",
            (f"{schema}.wake-listener",),
        ).fetchone()
    return None if row is None else int(row[0])


def client_port(url: str, backend: int) -> int | None:
    with psycopg.connect(url, connect_timeout=3) as conn:
        row = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE pid = %s", (backend,)
        ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def process_of_port(port: int) -> int | None:
    """The local process with a TCP socket bound to ``port`` (the client end of a session):
    its inode from /proc/net/tcp, then the process holding that inode open."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return int(pid)
        except OSError:
            continue
    return None


@dataclass
class Takeover:
    killed: str
    takeover_seconds: float | None  # kill -> another backend holds the listener lock
    rows_after: int
    worst_after: float | None  # the worst commit -> start of the rows committed after the kill
    back_under_1s: float | None  # kill -> the last start of a row that waited >= 1 s (0: none)


class FailoverRun(CellRun):
    def __init__(self, mc: MatrixConfig, services: Services, logdir: Path, out: TextIO, kills: int):
        super().__init__(mc, "failover", services, logdir, out)
        self.fleet.members = [
            Member("w0", "worker", "threads"),
            Member("w1", "worker", "threads"),
            Member("c0", "claimer", "threads"),
            Member("c1", "claimer", "threads"),
        ]
        self.kill_count = kills
        self.events: list[tuple[float, str, float | None]] = []  # kill at, whom, takeover

    def plan(self) -> list[Planned]:
        return plan_steady(self.config.rows, random.Random(self.config.seed), (("intent", 1.0),))

    def _cell_failover(self, producer: Producer) -> None:
        url, schema = self.settings.database_url, self.settings.schema
        for i in range(self.kill_count):
            at = self.mc.fault_at + i * self.mc.fault_for
            self._wait(producer, at)
            holder = listener_holder(url, schema)
            port = client_port(url, holder) if holder else None
            pid = process_of_port(port) if port else None
            pgid = os.getpgid(pid) if pid else None
            victim = next((m for m in self.fleet.up() if m.proc and m.proc.pid == pgid), None)
            if victim is None:
                self.notes.append(f"kill {i + 1}: no process found holding the listener")
                continue
            kill = self.fleet.kill(victim, restart_in=self.mc.fault_for / 2)
            self.kills.append(kill)
            self._fault("kill -9", f"{victim.name} (its listener held the lock)")
            takeover = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = listener_holder(url, schema)
                if now not in (None, holder):
                    takeover = time.time() - kill.at
                    break
                time.sleep(0.05)
            self.events.append((kill.at, victim.name, takeover))


def takeovers(
    events: list[tuple[float, str, float | None]],
    committed_at: dict[int, float],
    starts: dict[int, float],
) -> list[Takeover]:
    """Per kill (its time, whom, when the lock was taken over): the rows committed from it to
    the next kill, their worst commit -> start, and how long after the kill the last of them
    that waited ``SLOW`` or more started (0: none did; None: a row never started)."""
    out = []
    bounds = [at for at, _, _ in events[1:]] + [float("inf")]
    for (at, name, takeover), until in zip(events, bounds, strict=True):
        rows = [r for r, c in committed_at.items() if at <= c < until]
        lat = {r: starts[r] - committed_at[r] for r in rows if r in starts}
        slow = [starts[r] for r, v in lat.items() if v >= SLOW]
        back = None if len(lat) < len(rows) else round(max(slow) - at, 2) if slow else 0.0
        out.append(
            Takeover(
                killed=name,
                takeover_seconds=None if takeover is None else round(takeover, 2),
                rows_after=len(rows),
                worst_after=round(max(lat.values()), 3) if lat else None,
                back_under_1s=back,
            )
        )
    return out


def failover(mc: MatrixConfig, kills: int, out: TextIO) -> list[Takeover]:
    logdir = _logdir(mc, "failover")
    with Services(logdir) as services:
        reset(services)
        out.write(f"listener failover: {kills} kills, {mc.rate:g} commits/s; logs in {logdir}\n")
        run = FailoverRun(mc, services, logdir, out, kills)
        report = run.run()
        result = result_of(run, report)
    rec = run.records
    assert rec is not None
    out_list = takeovers(run.events, rec.committed_at, first_starts(rec))
    (logdir / "failover.json").write_text(
        json.dumps({"kills": [asdict(t) for t in out_list], "cell": result.jsonable()}, indent=2)
    )
    if not result.ok:
        out.write("failover run's checks failed: " + "; ".join(result.failed) + "\n")
    return out_list


def render_failover(takeovers: list[Takeover]) -> str:
    lines = [
        "",
        "| kill -9 of the listener's worker | lock taken over after | rows committed after"
        " | worst commit → start after | commit → start back under 1 s after |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for t in takeovers:
        over = "-" if t.takeover_seconds is None else f"{t.takeover_seconds:.2f} s"
        worst = "-" if t.worst_after is None else f"{t.worst_after:.2f} s"
        back = "never" if t.back_under_1s is None else f"{t.back_under_1s:.2f} s"
        lines.append(f"| {t.killed} | {over} | {t.rows_after} | {worst} | {back} |")
    return "\n".join(lines)


def _logdir(mc: MatrixConfig, what: str) -> Path:
    logdir = (
        Path(mc.logdir)
        if mc.logdir
        else Path(tempfile.mkdtemp(prefix=f"outbox-{what}-{time.strftime('%Y%m%d-%H%M%S')}-"))
    )
    logdir.mkdir(parents=True, exist_ok=True)
    return logdir


def parse(argv: list[str]) -> tuple[str, MatrixConfig, int, bool]:
    p = argparse.ArgumentParser(
        prog="scripts/chaos --rolling | --failover",
        description="A rolling deploy under load, or the commit listener's failover, measured.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rolling", action="store_true", help="a rolling deploy under load")
    mode.add_argument("--failover", action="store_true", help="kill -9 the listener's worker")
    p.add_argument("--rate", type=float, default=None, help="rows/s (rolling 100, failover 10)")
    p.add_argument("--load", type=float, default=None, help="s of load (rolling 60, failover 50)")
    p.add_argument(
        "--start-at",
        type=float,
        default=10.0,
        help="s into the load the roll or the first kill comes (%(default)s)",
    )
    p.add_argument("--nodes", type=int, default=3, help="rolling: worker nodes (%(default)s)")
    p.add_argument("--kills", type=int, default=3, help="failover: kills (%(default)s)")
    p.add_argument(
        "--kill-every", type=float, default=12.0, help="failover: s between kills (%(default)s)"
    )
    p.add_argument("--lease", type=float, default=10.0, help="s (%(default)s)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="s (%(default)s)")
    p.add_argument("--seed", type=int, default=1, help="the workload (%(default)s)")
    p.add_argument("--logdir", default="", help="logs and JSON (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="JSON on stdout, progress on stderr")
    a = p.parse_args(argv)
    what = "rolling" if a.rolling else "failover"
    rate = a.rate if a.rate is not None else (100.0 if a.rolling else 10.0)
    load = a.load if a.load is not None else (60.0 if a.rolling else a.start_at + 40.0)
    if rate <= 0 or load < 5 or a.nodes < 1 or a.kills < 1 or a.lease < 1:
        p.error("need --rate > 0, --load >= 5, --nodes >= 1, --kills >= 1, --lease >= 1")
    mc = replace(
        MatrixConfig(),
        rate=rate,
        load=load,
        fault_at=a.start_at,
        fault_for=a.kill_every,
        lease=a.lease,
        heartbeat_timeout=a.heartbeat_timeout,
        seed=a.seed,
        chunk=5 if a.rolling else 1,
        logdir=a.logdir,
    )
    return what, mc, a.nodes if a.rolling else a.kills, a.json


def main(argv: list[str]) -> int:
    what, mc, n, as_json = parse(argv)
    out = sys.stderr if as_json else sys.stdout
    if what == "rolling":
        r = rolling(mc, n, out)
        print(json.dumps(r.jsonable(), indent=2) if as_json else render_rolling(r))
        return 0 if r.cell.ok else 1
    takeovers = failover(mc, n, out)
    if as_json:
        print(json.dumps([asdict(t) for t in takeovers], indent=2))
    else:
        print(render_failover(takeovers))
    return 0 if takeovers and all(t.takeover_seconds is not None for t in takeovers) else 1
