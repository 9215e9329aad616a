"""Resident memory of a worker and its pool children, read from ``/proc`` (Linux).

VmRSS from ``/proc/<pid>/status`` is what the kernel charges the process now; summing it over
the worker's process tree catches a leak in the parent or in any prefork child.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def parse_vmrss(status: str) -> int | None:
    """VmRSS in kB from the text of ``/proc/<pid>/status`` (None for a zombie or kernel task)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1])
    return None


def parse_ppid(stat: str) -> int | None:
    """The parent pid from the text of ``/proc/<pid>/stat``; the command name (field 2) may
    hold spaces and parentheses, so fields are counted after its last ')'."""
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2 or not fields[1].lstrip("-").isdigit():
        return None
    return int(fields[1])


def children(pid: int, proc: Path = PROC) -> list[int]:
    """Direct children of ``pid``, by scanning every process's parent."""
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = parse_ppid((entry / "stat").read_text())
        except OSError:
            continue  # exited while we looked
        if ppid == pid:
            out.append(int(entry.name))
    return sorted(out)


def tree(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p, proc)
    return sorted(out)


def tree_rss(pid: int, proc: Path = PROC) -> dict[int, int]:
    """VmRSS in kB of every live process in ``pid``'s tree."""
    out: dict[int, int] = {}
    for p in tree(pid, proc):
        try:
            kb = parse_vmrss((proc / str(p) / "status").read_text())
        except OSError:
            continue
        if kb is not None:
            out[p] = kb
    return out


def available() -> bool:
    return (PROC / str(os.getpid()) / "status").exists()
