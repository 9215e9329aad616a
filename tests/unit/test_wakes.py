"""How the commit listener reads a batch of NOTIFY payloads (listener.read_wakes): families to
claim, and rows to hand over unclaimed."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.listener import Named, read_wakes


def test_a_named_row_is_handed_over_unless_its_family_also_sent_a_plain_wake() -> None:
    payloads = [
        json.dumps(["quick", 1, "t.a", None]),
        json.dumps(["bulk", 2, "t.b", "ann"]),
        "bulk",  # the same transaction (or another) has more rows: a claim takes them all
        json.dumps(["quick", 3, "t.a", "bob"]),
        "plain",
    ]
    families, named = read_wakes(payloads)
    assert families == {"bulk", "plain"}
    assert named == {"quick": [Named("quick", 1, "t.a", None), Named("quick", 3, "t.a", "bob")]}


def test_a_payload_that_does_not_parse_names_nothing() -> None:
    bad = ["[", "[1, 2]", '["q", "1", "c", null]', '["q", true, "c", null]', '["q", 1, 2, null]']
    assert read_wakes(bad) == (set(), {})


@given(
    st.lists(st.one_of(st.text(), st.lists(st.integers() | st.text() | st.none()).map(json.dumps)))
)
def test_any_payload_is_read_without_raising(payloads: list[str]) -> None:
    families, named = read_wakes(payloads)
    assert not families & set(named)
    assert all(isinstance(r, Named) for rows in named.values() for r in rows)
