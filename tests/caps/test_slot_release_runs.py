"""How held slot releases are grouped into script runs (caps_pipelined.runs)."""

from __future__ import annotations

import uuid

from outbox_dispatch.caps.releases import runs
from outbox_dispatch.caps.semaphore import Slot


def test_held_releases_run_one_script_per_family_and_database_in_first_seen_order() -> None:
    """caps_release.lua notes freed slots for one family's claimers and wakes one
    database's: each (family, database) gets a run of its own, slots in the order held."""
    a, b, c, d = (Slot(f, x, uuid.uuid4(), 1) for f, x in ("fa", "gb", "fc", "fd"))
    found = runs([(a, None), (b, None), (c, None), (d, "db2")])
    assert [(r.slots, r.database) for r in found] == [((a, c), None), ((b,), None), ((d,), "db2")]
