"""Families as declared, pure: bad policies and backoffs are refused; the built-in families."""

from __future__ import annotations

import pytest

from outbox_dispatch import Backoff, ConfigurationError, Family
from outbox_dispatch.core.policy import builtin_families


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"lease": 0.5},
        {"max_in_flight": 0},
        {"per_actor": 0},
        {"retention": -1},
        {"name": "Bad-Name"},
        {"name": "x" * 49},
    ],
)
def test_bad_family_policy_is_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"name": "ok", **kwargs}
    with pytest.raises(ConfigurationError):
        Family(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"base": 0}, {"base": 2, "cap": 1}, {"jitter": 1.5}, {"base": float("inf")}]
)
def test_bad_backoff_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        Backoff(**kwargs)


def test_builtin_families() -> None:
    fams = builtin_families()
    assert fams["intent"].max_attempts is None
    assert fams["job"].max_attempts is not None
    assert fams["job"].lease > fams["intent"].lease
