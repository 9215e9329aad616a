"""CPU time per delivered row, by process group, read from /proc.

On a 2-core machine that Postgres, Redis, the driver and the worker share, throughput is
about two cores divided by the CPU each row costs, so these figures say where a system's
time goes and what a ratio between two systems is made of. Each group counts its live
processes and the children they have reaped (``cutime``/``cstime``): a Postgres backend that
closed between two samples is still counted, through the postmaster. Postgres and Redis are
shared with the rest of the machine, so their figures include whatever else ran meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("worker", "postgres", "redis", "driver")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    name: str
    ticks: int  # own user + system time, and that of the children it reaped


def parse_stat(text: str) -> Proc:
    """One /proc/<pid>/stat line; the name is in parentheses and may hold spaces."""
    head, _, rest = text.rpartition(")")
    pid, _, name = head.partition(" (")
    fields = rest.split()
    # fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17
    return Proc(int(pid), int(fields[1]), name, sum(int(f) for f in fields[11:15]))


def read_procs(proc: Path = Path("/proc")) -> list[Proc]:
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found.append(parse_stat((entry / "stat").read_text()))
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return found


def group_ticks(procs: Iterable[Proc], roots: Iterable[int], driver: int) -> dict[str, int]:
    """Ticks per group: ``worker`` is every process under ``roots`` (the system's own
    processes), ``driver`` is the benchmark process, then Postgres and Redis by name."""
    procs = list(procs)
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    system: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid not in system:
            system.add(pid)
            stack.extend(children.get(pid, ()))
    totals = dict.fromkeys(GROUPS, 0)
    for p in procs:
        if p.pid in system:
            totals["worker"] += p.ticks
        elif p.pid == driver:
            totals["driver"] += p.ticks
        elif p.name == "postgres" or p.name.startswith("postgres:"):
            totals["postgres"] += p.ticks
        elif p.name.startswith("redis-server"):
            totals["redis"] += p.ticks
    return totals


def sample(roots: Iterable[int]) -> dict[str, int]:
    return group_ticks(read_procs(), roots, os.getpid())


def per_row_ms(before: Mapping[str, int], after: Mapping[str, int], rows: int) -> dict[str, float]:
    """Milliseconds of CPU per row for each group, and their total."""
    out = {
        g: round(max(0, after.get(g, 0) - before.get(g, 0)) * 1000 / TICKS / max(rows, 1), 3)
        for g in GROUPS
    }
    out["total"] = round(sum(out[g] for g in GROUPS), 3)
    return out
