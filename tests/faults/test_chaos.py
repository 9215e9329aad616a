"""The chaos suite, small: 1,000 rows over 30 s through 3 workers (threads, prefork, threads)
and 2 claimers while they are killed -9 every few seconds (one claimer or both), broker
connections are cut, Redis is flushed and restarts with its data lost, and Postgres is killed
-9 and stopped by a fast shutdown; then no row may be lost, doubled where it must not be, or
delivered by an attempt whose handler gave up on ``ctx.is_cancelled``, no cap or order broken,
and every row must settle within 2 * max(lease, heartbeat_timeout) of the last fault (the
state of each one that did not is in the failure message).

It runs ``python -m tests.chaos.run`` as a process, on its own private Postgres and
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

from tests.chaos.report import unsettled_lines
from tests.chaos.services import ServiceError, preflight
from tests.fixtures.processes import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ["--rows", "1000", "--duration", "30", "--workers", "3", "--lease", "5"]
# started attempts of killed workers are noticed after 3 s, queued messages after 5 s: on this
# 2-core machine, a family at max_in_flight 2 behind two such rows needs the difference
ARGS += ["--heartbeat-timeout", "3"]
ARGS += ["--fault-interval", "2.5", "--seed", "7", "--pools", "threads,prefork"]


def _chaos(logdir: Path) -> tuple[dict[str, Any], float]:
    with (logdir / "orchestrator.log").open("wb") as progress:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.chaos.run",
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
        f" {report['dup_other']['extra']} (flagged {report['dup_other']['flagged']}), cap peaks"
        f" {report['cap_peak']}, gave up on is_cancelled {report['gave_up_by_family']},"
        f" soft time limits {report['soft_limit_runs']}, settle {report['settle_seconds']} s"
        f" after a kill that stranded {report['stranded_by_last_fault']} runs, {took:.0f} s in all"
    )
    states = "\n".join(unsettled_lines(report["unsettled_rows"], report["unsettled_count"]))
    assert not failed, (
        "chaos checks failed:\n"
        + "\n".join(f"  {v['name']}: {v['value']} (limit {v['limit']})" for v in failed)
        + f"\ndelivered by an unfinished attempt: {report['delivered_unfinished'][:10]}"
        + f"\nlost rows: {report['lost_rows'][:20]}\n{states}\nlogs in {tmp_path}"
    )
    assert report["ok"]
    # the run really exercised what it checks: every fault kind, both caps reached, kills that
    # hit handlers in progress, polite handlers told to stop (threads: the time limit reached
    # them as is_cancelled) and interrupted (prefork: SoftTimeLimitExceeded)
    assert sorted(report["faults"]) == sorted(report["fault_kinds"]), report["faults"]
    assert report["cap_peak"] == {"capped": 2, "polite": 2}
    assert report["maybe_applied_runs"] > 0
    assert report["gave_up_by_family"].get("limited", 0) > 0
    assert report["soft_limit_runs"] > 0
