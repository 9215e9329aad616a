"""Our exceptions survive what Celery and Python do to exceptions: pickling (a pool process
sends one to its parent) and copying."""

from __future__ import annotations

import copy
import pickle
from datetime import timedelta

import pytest

from outbox_dispatch import RetryLater


@pytest.mark.parametrize("delay", [5, 2.5, timedelta(minutes=1)])
def test_retry_later_keeps_its_delay_and_message_through_pickle_and_copy(delay: object) -> None:
    raised = RetryLater(delay, "the API said 429")  # type: ignore[arg-type]
    for again in (pickle.loads(pickle.dumps(raised)), copy.copy(raised)):  # noqa: S301 - ours
        assert isinstance(again, RetryLater)
        assert (again.delay, str(again)) == (raised.delay, "the API said 429")
    bare = pickle.loads(pickle.dumps(RetryLater(1)))  # noqa: S301 - our own bytes
    assert bare.delay == 1.0 and str(bare) == str(RetryLater(1))
