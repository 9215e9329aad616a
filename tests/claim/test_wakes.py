"""Which family a commit's NOTIFY wakes (listener.family_of), from this version's producers
(the family's name) and from earlier ones still running while a deploy rolls (a JSON array
naming the transaction's first row)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.claim.listener import family_of


def test_a_family_name_wakes_that_family() -> None:
    assert family_of("webhook") == "webhook"


def test_an_earlier_producers_named_row_wakes_its_family() -> None:
    assert family_of('["quick", 12, "t.a", null]') == "quick"


@given(st.text())
def test_any_payload_is_read_without_raising(payload: str) -> None:
    assert isinstance(family_of(payload), str)
