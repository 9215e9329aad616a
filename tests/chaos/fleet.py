"""The worker and claimer processes of a chaos run: started, killed -9 and restarted.

Delivery workers consume the family queues, on the pools named in turn (by default threads
and prefork alternate: a threads worker can only stop a handler through ``ctx.is_cancelled``,
a prefork one raises SoftTimeLimitExceeded in it and kills its pool process). The two
claimers are ``celery worker -B`` processes on the claim queue only: each runs beat (so there
are two schedulers), consumes claim tasks and runs the NOTIFY listener (one leads, the other
stands by). A node (the rolling deploy's) does both: it consumes the delivery and claim
queues and runs a listener, without beat. Every process runs in its own session, so a kill -9
of its process group takes its pool children and its embedded beat with it, as a container
kill would.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .checks import Kill
from .workload import CLAIM_QUEUE, DELIVERY_QUEUES, Settings, with_role

APP = "tests.chaos.app"
POOLS = ("prefork", "threads")


@dataclass
class Member:
    name: str
    role: str  # worker | claimer | node
    pool: str  # prefork | threads
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    starts: int = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def children_of(pid: int) -> list[int]:
    """Live direct children of a process, from /proc (a prefork worker's pool processes); a
    killed child not reaped yet (a zombie) is not one."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields resume after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


class Fleet:
    def __init__(
        self,
        settings: Settings,
        logdir: Path,
        *,
        workers: int,
        claimers: int = 2,
        rng: random.Random,
        pools: Sequence[str] = ("threads", "prefork"),
        env: Mapping[str, str] | None = None,
    ) -> None:
        unknown = [p for p in pools if p not in POOLS]
        if not pools or unknown:
            raise ValueError(f"worker pools must be some of {POOLS}, got {list(pools)}")
        self.settings = settings
        self.logdir = logdir
        self.rng = rng
        self.env = dict(env or {})  # more variables for every process (a clock shim)
        self.members = [
            Member(f"w{i}", "worker", pools[i % len(pools)]) for i in range(workers)
        ] + [Member(f"c{i}", "claimer", "threads") for i in range(claimers)]

    def command(self, m: Member) -> list[str]:
        base = [sys.executable, "-m", "celery", "-A", APP, "worker", "-n", f"{m.name}@%h"]
        level = os.environ.get("CHAOS_LOGLEVEL", "WARNING")  # INFO: every row's lines
        base += ["--loglevel", level, "--without-gossip", "--without-mingle"]
        if m.role == "claimer":
            # a fresh schedule file per start: a killed beat may leave a corrupt one behind
            beat = self.logdir / "beat"
            beat.mkdir(exist_ok=True)
            for old in beat.glob(f"{m.name}-*"):
                old.unlink()
            schedule = beat / f"{m.name}-{m.starts}"
            return [*base, "-B", "-s", str(schedule), "-Q", CLAIM_QUEUE, "-P", "threads", "-c", "2"]
        if m.role == "node":
            queues = f"{CLAIM_QUEUE},{DELIVERY_QUEUES}"
            return [*base, "-Q", queues, "-P", "threads", "-c", "8"]
        concurrency = "2" if m.pool == "prefork" else "4"
        return [*base, "-Q", DELIVERY_QUEUES, "-P", m.pool, "-c", concurrency]

    def start(self, m: Member) -> None:
        env = {
            **os.environ,
            **with_role(self.settings, m.role).env(),
            **self.env,
            "PYTHONUNBUFFERED": "1",
        }
        cmd = self.command(m)
        with (self.logdir / f"{m.name}.log").open("ab") as out:
            out.write(f"\n=== start {m.starts} at {time.time():.3f}: {' '.join(cmd)}\n".encode())
            out.flush()
            m.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        m.started_at = time.monotonic()
        m.restart_at = None
        m.starts += 1

    def add(self, name: str, role: str = "worker", pool: str = "threads") -> Member:
        """One more member, not started yet."""
        m = Member(name, role, pool)
        self.members.append(m)
        return m

    def start_all(self) -> None:
        for m in self.members:
            self.start(m)

    def up(self, role: str | None = None, settled_for: float = 0.0) -> list[Member]:
        """Running members (of a role), started at least ``settled_for`` seconds ago."""
        now = time.monotonic()
        return [
            m
            for m in self.members
            if m.running and (role is None or m.role == role) and now - m.started_at >= settled_for
        ]

    def kill(self, m: Member, restart_in: float) -> Kill:
        """kill -9 the member's process group; it comes back after ``restart_in`` seconds."""
        assert m.proc is not None
        pgid = m.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        at = time.time()
        m.proc.wait()
        m.proc = None
        m.restart_at = time.monotonic() + restart_in
        self._note(m, f"kill -9 of process group {pgid}")
        return Kill(at, pgid=pgid)

    def stop(self, m: Member, timeout: float = 60.0) -> float:
        """SIGTERM to the member's main process, as a deploy stops a worker (Celery's warm
        shutdown: it stops consuming and waits for the tasks it runs), and wait until it exited;
        kill -9 after ``timeout``. Returns how long it took to exit."""
        assert m.proc is not None
        t0 = time.monotonic()
        self._note(m, "SIGTERM (warm shutdown)")
        with contextlib.suppress(ProcessLookupError):
            m.proc.send_signal(signal.SIGTERM)
        try:
            m.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._note(m, f"still running {timeout:g} s after SIGTERM: kill -9")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(m.proc.pid, signal.SIGKILL)
            m.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # pool children it left behind
            os.killpg(m.proc.pid, signal.SIGKILL)
        m.proc = None
        m.restart_at = None
        return time.monotonic() - t0

    def kill_pool_child(self, m: Member) -> Kill | None:
        """kill -9 one pool process of a prefork worker: Celery replaces it and requeues its
        message (reject_on_worker_lost)."""
        assert m.proc is not None
        kids = children_of(m.proc.pid)
        if not kids:
            return None
        victim = self.rng.choice(kids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        self._note(m, f"kill -9 of pool process {victim}")
        return Kill(time.time(), pid=victim)

    def restart_due(self) -> None:
        now = time.monotonic()
        for m in self.members:
            if not m.running and m.restart_at is not None and m.restart_at <= now:
                self.start(m)

    def revive_all(self) -> None:
        """Every member running again (the fault phase is over), including any that exited."""
        for m in self.members:
            if not m.running:
                self.start(m)

    def exited(self) -> list[Member]:
        """Members that died without being killed by us (a crash to report)."""
        return [m for m in self.members if m.proc is not None and m.proc.poll() is not None]

    def stop_all(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(m.proc.pid, signal.SIGKILL)
                m.proc.wait()
            m.proc = None

    def _note(self, m: Member, what: str) -> None:
        with (self.logdir / f"{m.name}.log").open("ab") as out:
            out.write(f"\n=== chaos at {time.time():.3f}: {what}\n".encode())
