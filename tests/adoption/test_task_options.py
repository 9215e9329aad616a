"""A Celery call's options as a row, pure: each option mapped, refused or ignored, at the edges
of its type."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.celery.task_options import (
    IGNORED,
    REFUSED,
    decode_call,
    encode_call,
    plan_call,
    retry_delay,
)
from outbox_dispatch.core.errors import InvalidArgument, InvalidPayload
from outbox_dispatch.core.policy import Family
from outbox_dispatch.core.settle import SettleKind, retry_asked

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def plan(args: Any = (), kwargs: Any = None, **options: Any) -> Any:
    return plan_call("shop.t", args, kwargs, options, now=NOW)


def test_a_plain_call_is_its_args_and_kwargs_and_nothing_else() -> None:
    call = plan((1, "a"), {"k": [1, 2]})
    assert call.payload == {"args": [1, "a"], "kwargs": {"k": [1, 2]}}
    assert (call.delay, call.at, call.queue, call.dedupe_key, call.actor) == (None,) * 5


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_refused_option_says_why_and_what_to_do(key: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"apply_async\({key}=\.\.\.\) is refused: .+"):
        plan(**{key: ["x"]})


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_message_options_are_accepted_and_change_nothing(key: str) -> None:
    assert plan((1,), **{key: "x"}) == plan((1,))


def test_an_unknown_option_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="option 'colour'"):
        plan(colour="red")


@pytest.mark.parametrize("countdown", [0, -5, 0.0])
def test_a_countdown_not_in_the_future_is_due_now(countdown: float) -> None:
    assert plan(countdown=countdown).delay is None


@pytest.mark.parametrize("bad", [True, "10", math.nan, None])
def test_a_countdown_that_is_not_a_number_is_refused(bad: Any) -> None:
    if bad is None:
        assert plan(countdown=None).delay is None  # not given
        return
    with pytest.raises(InvalidArgument, match="countdown"):
        plan(countdown=bad)


def test_a_countdown_past_what_a_timedelta_holds_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="out of range"):
        plan(countdown=1e20)
    assert plan(countdown=1.5).delay == timedelta(seconds=1.5)


def test_a_naive_eta_is_in_the_apps_timezone_and_an_aware_one_kept() -> None:
    naive = datetime(2026, 12, 24, 9, 0)
    paris = ZoneInfo("Europe/Paris")
    call = plan_call("shop.t", (), None, {"eta": naive}, now=NOW, tz=paris)
    assert call.at == naive.replace(tzinfo=paris)
    aware = datetime(2026, 12, 24, 9, 0, tzinfo=UTC)
    assert plan(eta=aware).at == aware
    assert plan(eta="2026-12-24T09:00:00+00:00").at == aware
    with pytest.raises(InvalidArgument, match="ISO 8601"):
        plan(eta="tomorrow")
    with pytest.raises(InvalidArgument, match="must be a datetime"):
        plan(eta=12)


def test_expires_in_seconds_or_at_a_time_is_kept_as_an_absolute_time() -> None:
    assert plan(expires=60).payload["expires"] == (NOW + timedelta(seconds=60)).isoformat()
    at = datetime(2026, 12, 2, tzinfo=UTC)
    assert decode_call(plan(expires=at).payload).expires == at
    with pytest.raises(InvalidArgument, match="out of range"):
        plan(expires=1e20)


def test_queue_task_id_actor_and_dedupe_key() -> None:
    class Queue:
        name = "emails"

    assert plan(queue=Queue()).queue == "emails"
    assert plan(queue="emails").queue == "emails"
    by_id = plan(task_id="receipt-1")
    assert by_id.dedupe_key == "shop.t:receipt-1" and by_id.task_id == "receipt-1"
    assert decode_call(by_id.payload).task_id == "receipt-1"
    assert plan(task_id="r", dedupe_key="mine").dedupe_key == "mine"  # an explicit key wins
    assert plan(dedupe_key="k", actor="user:1").actor == "user:1"
    with pytest.raises(InvalidArgument, match="actor must be a str"):
        plan(actor=5)
    with pytest.raises(InvalidArgument, match="queue must be"):
        plan(queue="")


def test_arguments_json_cannot_carry_are_refused_and_celerys_json_types_round_trip() -> None:
    with pytest.raises(InvalidPayload, match="cannot be written as JSON"):
        encode_call("shop.t", (object(),), {})
    with pytest.raises(InvalidArgument, match="args must be a list or tuple"):
        encode_call("shop.t", "abc", {})
    with pytest.raises(InvalidArgument, match="str keys"):
        encode_call("shop.t", (), {1: 2})
    values = [NOW, Decimal("0.10"), b"raw", NOW.date()]
    decoded = decode_call(encode_call("shop.t", values, {"when": NOW}))
    assert decoded.args == values and decoded.kwargs == {"when": NOW}


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=10,
    )
)
def test_any_json_argument_arrives_as_it_was_sent(value: Any) -> None:
    assert decode_call(encode_call("shop.t", [value], {"v": value})).args == [value]


@pytest.mark.parametrize("payload", [None, [], {"args": 1}, {"args": [], "kwargs": []}])
def test_a_payload_no_call_wrote_is_refused(payload: Any) -> None:
    with pytest.raises(ValueError, match="not a task call"):
        decode_call(payload)


def test_retry_delay_from_a_countdown_an_eta_or_the_tasks_default() -> None:
    assert retry_delay(5, 180, NOW) == 5.0
    assert retry_delay(NOW + timedelta(seconds=30), 180, NOW) == 30.0
    assert retry_delay(NOW - timedelta(seconds=30), 180, NOW) == 0.0
    assert retry_delay(None, 180, NOW) == 180.0
    assert retry_delay(-3, 180, NOW) == 0.0


def test_a_retry_asked_for_parks_once_the_familys_attempts_ran_out() -> None:
    fam = Family("x", max_attempts=3)
    assert retry_asked(fam, 2, 7.0, "busy").kind is SettleKind.RETRY
    assert retry_asked(fam, 2, 7.0, "busy").delay == 7.0
    parked = retry_asked(fam, 3, 7.0, "busy")
    assert parked.kind is SettleKind.PARK and "max_attempts ran out" in (parked.error or "")
    assert retry_asked(Family("y", max_attempts=None), 99, 1.0, "e").kind is SettleKind.RETRY
