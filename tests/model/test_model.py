"""The model-based test of the whole outbox against the real Postgres and Redis: hypothesis
drives ``ModelMachine`` (machine.py) through its rules, and the invariants (invariants.py)
are checked after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.model.machine import Env, ModelMachine

pytestmark = pytest.mark.usefixtures("clean")


MODEL_SETTINGS = settings(
    max_examples=200,  # about 25 s here; most bugs above took 10-150 examples to show
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_model(model_env: Env) -> None:
    run_state_machine_as_test(ModelMachine, settings=MODEL_SETTINGS)
