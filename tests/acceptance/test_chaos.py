"""The chaos suite, small: 2,000 rows over 60 s through 3 workers and 2 claimers while they are
killed -9 every few seconds, broker connections are cut, Redis restarts with its data lost and
Postgres restarts; then no row may be lost or doubled where it must not be, no cap or order
broken, and the outbox must settle within 2 leases of the last fault.

It runs ``python -m outbox_dispatch.chaos.run`` as a process, on its own private Postgres and
Redis (the shared services are not touched); ``scripts/chaos`` is the long version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from outbox_dispatch.chaos.services import ServiceError, preflight
from tests.acceptance.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ["--rows", "2000", "--duration", "60", "--workers", "3", "--lease", "5"]
ARGS += ["--fault-interval", "3", "--seed", "7"]


def _chaos(logdir: Path) -> tuple[dict[str, Any], float]:
    with (logdir / "orchestrator.log").open("wb") as progress:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "outbox_dispatch.chaos.run",
                *ARGS,
                "--json",
                "--logdir",
                logdir,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=progress,
            start_new_session=True,
        )
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:  # it stops its workers and services on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    took = time.monotonic() - t0
    tail = (logdir / "orchestrator.log").read_text(errors="replace")[-3000:]
    assert proc.returncode in (0, 1), f"the chaos run crashed ({proc.returncode}): {tail}"
    return json.loads(out), took


def test_chaos_small(tmp_path: Path) -> None:
    try:
        preflight()
    except ServiceError as exc:
        pytest.skip(str(exc))
    report, took = _chaos(tmp_path)
    failed = [v for v in report["verdicts"] if not v["ok"]]
    print(
        f"\nchaos (small): {report['rows']} rows, faults {report['faults']}, lost"
        f" {report['lost']}, duplicates txn {report['dup_txn']['extra']} / other"
        f" {report['dup_other']['extra']} (flagged {report['dup_other']['flagged']}), cap peak"
        f" {report['cap_peak']}, settle {report['settle_seconds']} s after a kill that"
        f" stranded {report['stranded_by_last_fault']} runs, {took:.0f} s in all"
    )
    assert not failed, f"chaos checks failed: {failed}; logs in {tmp_path}"
    assert report["ok"]
    # the run really exercised what it checks: every fault kind, the cap reached, kills that
    # hit handlers in progress
    assert len(report["faults"]) == 6, report["faults"]
    assert report["cap_peak"] == 2
    assert report["maybe_applied_runs"] > 0
