"""The rows a worker handed over unclaimed, which its own claims leave alone for a moment."""

from __future__ import annotations

import time

from outbox_dispatch.handed import HandedRows


def test_handed_rows_are_held_for_their_family_until_the_hold_passes() -> None:
    handed = HandedRows(hold=0.05)
    handed.add("mail", [1, 2])
    handed.add("sms", [3])
    assert sorted(handed.held("mail")) == [1, 2] and handed.held("sms") == [3]
    assert handed.held("other") == []
    time.sleep(0.06)
    assert handed.held("mail") == [] and handed.held("sms") == []


def test_a_family_never_claimed_does_not_keep_its_handed_rows() -> None:
    """Every row of a family may start where it was handed, so that this worker never claims
    it: what its hand-overs remember must not grow with them."""
    handed = HandedRows(hold=0.2)
    for row_id in range(300):
        handed.add("mail", [row_id])
        time.sleep(0.005)
    assert len(handed) < 100  # a hold's worth (at most 41), not all 300
    assert handed.held("mail")[-1] == 299
