"""Enqueue input checks, without a database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch import InvalidArgument, InvalidPayload, PayloadTooLarge
from outbox_dispatch.core.validation import due_offset, encode_payload, prepare

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text().filter(lambda s: "\x00" not in s),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=8).filter(lambda s: "\x00" not in s), children, max_size=4
        )
    ),
    max_leaves=20,
)


@given(json_values)
def test_any_json_value_round_trips(value: Any) -> None:
    assert json.loads(encode_payload(value, 10**6)) == value


def test_size_limit_counts_utf8_bytes() -> None:
    assert encode_payload("é" * 4, 10)  # 8 bytes + quotes
    with pytest.raises(PayloadTooLarge, match="11 bytes, over the 10-byte limit"):
        encode_payload("é" * 4 + "x", 10)


@pytest.mark.parametrize(
    "payload",
    [object(), {"a": {1, 2}}, float("inf"), {"k": [float("nan")]}, {None: 1}, {"a\x00": 1}],
)
def test_unstorable_payloads_are_refused(payload: Any) -> None:
    with pytest.raises(InvalidPayload):
        encode_payload(payload, 10**6)


def test_due_offset() -> None:
    assert due_offset(None, None) == (0.0, None)
    assert due_offset(timedelta(seconds=3), None) == (3.0, None)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    assert due_offset(None, at) == (0.0, at)
    for delay, when in [
        (3, None),
        (timedelta(seconds=-1), None),
        (None, "2030-01-01"),
        (None, datetime(2030, 1, 1)),
        (timedelta(1), at),
    ]:
        with pytest.raises(InvalidArgument):
            due_offset(delay, when)


def test_prepare_keeps_what_it_checked() -> None:
    row = prepare(
        family="intent",
        command="c",
        payload={"a": 1},
        actor="user:1",
        dedupe_key="k",
        delay=None,
        at=None,
        payload_limit=100,
    )
    assert (row.payload_json, row.actor, row.dedupe_key) == ('{"a":1}', "user:1", "k")


def test_lone_surrogates_are_refused_clearly() -> None:
    with pytest.raises(InvalidPayload, match="not valid Unicode"):
        encode_payload({"name": "\ud800"}, 1000)
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        prepare(
            family="f",
            command="c",
            payload={},
            actor="\udfff",
            dedupe_key=None,
            delay=None,
            at=None,
            payload_limit=100,
        )
