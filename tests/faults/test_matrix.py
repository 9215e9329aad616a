"""The fault and pressure matrix (``scripts/chaos --matrix``, tests/chaos/matrix.py), small:
each cell is a few seconds of load through real worker and claimer processes on one private
Postgres cluster and Redis that every cell shares (each cell its own schema, Redis emptied in
between), with that cell's fault. Each asserts what the matrix reports for it: no row lost,
no row run twice without ``maybe_applied``, no cap or order breach, every row settled within
the harness's settle limit (2 x max(lease, heartbeat timeout) from the later of the fault's
end and the last commit), and the rest of the chaos run's checks; and that the fault really
happened as the cell says.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.clock import build_shim
from tests.chaos.matrix import CellResult, MatrixConfig, run_cell
from tests.chaos.services import ServiceError, Services, preflight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SMALL = MatrixConfig(
    rate=15.0,
    load=4.0,
    fault_at=1.5,
    fault_for=2.5,
    idle_for=2.0,
    kill_every=1.0,
    readers=3,
    clock_step=60.0,
    extra_workers=3,
    # sessions the workers' role may open: room for the 8 that 2 workers and a claimer hold
    # at their peak under this load, not for what the three worker processes that join at the
    # fault ask for (the test checks that sessions were refused)
    max_connections=15,
    workers=2,
    claimers=1,
    pools="threads",
    lease=5.0,
    heartbeat_timeout=2.0,
    late_wait=5.0,
    baseline=False,
)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    try:
        preflight()
    except ServiceError as exc:
        pytest.fail(f"the matrix's private Postgres and Redis cannot start here: {exc}")
    with Services(tmp_path_factory.mktemp("matrix-services")) as s:
        yield s


def cell(services: Services, name: str, tmp_path: Path) -> CellResult:
    out = io.StringIO()
    result = run_cell(services, SMALL, name, tmp_path, out)
    print(
        f"\n{name}: {result.rows} rows, lost {result.lost}, unflagged duplicates"
        f" {result.unflagged_duplicates}, breaches {result.cap_breaches}/{result.order_breaches},"
        f" fault -> settled {result.fault_to_settled} s, after the load"
        f" {result.settled_after_load} s (limit {result.settle_limit:g} s), commit -> start"
        f" p99 {result.start_p99} s max {result.start_max} s, workers' peak sessions"
        f" {result.peak_sessions}; {result.fault}"
    )
    return result


def assert_clean(r: CellResult) -> None:
    why = f"{r.cell}: {r.failed}; notes {r.notes}; logs in {r.logdir}"
    assert r.rows > 0, why
    # first: a row still unsettled when the wait ends counts as lost, though it may be late
    assert r.settled_after_load is not None and r.settled_after_load <= r.settle_limit, why
    assert r.lost == 0, why
    assert r.unflagged_duplicates == 0, why
    assert (r.cap_breaches, r.order_breaches) == (0, 0), why
    assert r.fault_to_settled is not None, why
    assert r.ok, why


def fleet_log(r: CellResult) -> str:
    return "".join(
        p.read_text(errors="replace")
        for p in Path(r.logdir).glob("*.log")
        if p.name not in ("postgres.log", "redis.log")
    )


def test_postgres_restart(services: Services, tmp_path: Path) -> None:
    r = cell(services, "postgres_restart", tmp_path)
    assert "pg_ctl stop -m fast" in r.fault
    assert_clean(r)


def test_pg_backend_kill(services: Services, tmp_path: Path) -> None:
    r = cell(services, "pg_backend_kill", tmp_path)
    assert int(r.fault.split()[0]) >= 3, r.fault  # the workers', claimer's, producer's sessions
    assert_clean(r)


def test_pool_exhaustion(services: Services, tmp_path: Path) -> None:
    r = cell(services, "pool_exhaustion", tmp_path)
    refused = ("remaining connection slots are reserved", "too many clients already")
    assert any(m in fleet_log(r) for m in refused), "no connection was ever refused"
    assert_clean(r)


def test_repeated_kills(services: Services, tmp_path: Path) -> None:
    r = cell(services, "repeated_kills", tmp_path)
    assert r.faults >= 2, r.fault
    assert_clean(r)


def test_idle_in_tx(services: Services, tmp_path: Path) -> None:
    r = cell(services, "idle_in_tx", tmp_path)
    assert "idle transaction ends" in r.fault, r.fault
    assert_clean(r)


def test_active_readers(services: Services, tmp_path: Path) -> None:
    r = cell(services, "active_readers", tmp_path)
    reads = int(r.fault.split("after ")[1].split()[0])
    assert reads > 0, r.fault
    assert_clean(r)


def test_redis_restart_lost(services: Services, tmp_path: Path) -> None:
    r = cell(services, "redis_restart_lost", tmp_path)
    assert "started empty" in r.fault
    assert_clean(r)


def test_clock_step_back(services: Services, tmp_path: Path) -> None:
    try:
        build_shim()
    except ServiceError as exc:
        pytest.fail(f"the clock shim needs a C compiler (Debian: apt-get install gcc): {exc}")
    r = cell(services, "clock_step_back", tmp_path)
    assert "60 s back" in r.fault
    assert_clean(r)
