"""What the model test found: its shrunk failing examples replayed step by step, and the same
defect at the store."""

from __future__ import annotations

import pytest

from outbox_dispatch.core.settle import SettleKind
from tests.model.invariants import BEAT, CAPPED, CMD, PLAIN
from tests.model.machine import Env, ModelMachine

pytestmark = pytest.mark.usefixtures("clean")


# -- what the model found ------------------------------------------------------------------
#
# A settle under a stale token deleted the row's pending cancel request. settle_cancel
# (sql/queries.sql) deleted the request in a data-modifying CTE and fenced only the UPDATE by
# the claim token; Postgres runs a data-modifying WITH to completion whether or not the main
# statement uses its rows, so a settle under an old token (Store._settle_on falls back to
# settle_cancel whenever the settle of its kind matched nothing) removed the request and
# returned None. The current holder then settled as delivered (or retried), as if nobody had
# asked to cancel. Reached by any attempt that outlives its claim (a handler told CLAIM_LOST
# that returns anyway, a worker paused past its lease) while the row's cancel is pending.
# Fixed in 15fc7e2 (the request is taken only under the current token); these two keep it so.


def test_replay_a_stale_settle_keeps_the_cancel_request(model_env: Env) -> None:
    """test_model's shrunk failing example, replayed step by step as hypothesis printed it."""
    state = ModelMachine()
    (rows_0,) = state.seed(focus=PLAIN, actors=["a"], then=[])
    state.consistent()
    state.claim(family=PLAIN, fates=["stall"])  # attempt 1 starts; its worker stalls
    state.consistent()
    state.world(op="+3")  # its lease (the heartbeat timeout) runs out
    state.consistent()
    state.cancel(how="id", rid=rows_0, i=0)  # started: a cancel request, for its holder to honour
    state.consistent()
    state.claim(family=PLAIN, fates=[])  # claimed again (a lost attempt); message in flight
    state.consistent()
    state.work(fate="resume ok", i=0)  # attempt 1 returns: LOST, its settle changes nothing
    state.consistent()
    state.teardown()


def test_a_stale_settle_leaves_the_cancel_request_to_the_holder(model_env: Env) -> None:
    """The same at the store: the current holder must settle the row as cancelled."""
    env, d = model_env, model_env.d
    env.reset()
    with env.tx.transaction():
        rid = d.enqueue(env.tx, CMD[PLAIN], {})
    fam = d.families[PLAIN]
    old = d.claimer.claim_family(fam).claimed[0]
    assert d.store.begin(rid, old.token, BEAT) is not None  # a worker starts it and stalls
    d.store.clock_offset = BEAT + 1  # the attempt's lease runs out
    new = d.claimer.claim_family(fam).claimed[0]  # claimed again, under a new token
    assert d.store.begin(rid, new.token, BEAT) is not None
    with env.tx.transaction():
        assert d.cancel(env.tx, rid).requested == [rid]
    assert d.store.settle(SettleKind.DELETE, rid, old.token) is None  # the stalled worker's
    assert env.snapshot().requests == {rid}, "a settle under a stale token ate the request"
    assert d.store.settle(SettleKind.DELETE, rid, new.token) is SettleKind.CANCEL


# A start's slot check renews an old claim's slot for a heartbeat timeout; a Postgres crash
# that loses the start puts the row back to its claim's lease, which may end first. The slot
# then outlives the row's lease, and the row's next claim (a lost attempt) finds the actor at
# its cap until the slot runs out. That is the cap doing its job (the attempt may still run),
# but the invariant read every live slot past its row's lease as a leak: the model now counts
# such a slot as held by the stalled attempt (ModelMachine.unrecorded).


def test_replay_a_lost_start_keeps_its_renewed_slot(model_env: Env) -> None:
    """test_model's shrunk failing example (a random run of 2026-12-05), replayed, with the
    claim after it."""
    state = ModelMachine()
    _rows_0, rows_1 = state.seed(focus=CAPPED, actors=["a"], then=["a"])
    for op in ("+1", "+1", "+2"):
        state.world(op=op)
        state.consistent()
    state.claim(family="focus", fates=["ok"])
    state.consistent()
    state.claim_packed(acts=["ok"] * 4, family="focus", hold=False, size=2)
    state.consistent()
    state.claim(family="focus", fates=["ok"])
    state.consistent()
    state.cancel(how="id", i=0, rid=rows_1)
    state.consistent()
    state.world(op="rebuild")  # the old claim's slot is restored, to the claim's lease
    state.consistent()
    state.claim_packed(acts=["ok"] * 4, family="focus", hold=False, size=2)
    state.consistent()
    state.work(fate="stall", i=0)  # its start renews the old claim's slot for BEAT
    state.consistent()
    state.postgres_loses_a_start(i=0)  # the row goes back to the claim's lease
    state.consistent()
    state.world(op="+1")  # the row's lease has run out, its slot has not
    state.consistent()
    state.claim(family="focus", fates=["ok"])  # claimed again, or waiting for the slot
    state.consistent()
    state.teardown()


# A heartbeat renews a capped row's slot before its lease (so that the lease never outlives
# the slot), and went on holding that slot after the renewal found the claim lost. The claim
# that took the row again saw a holder its heartbeat had just renewed and kept the slot for a
# whole heartbeat timeout: the actor had one slot fewer than its cap. Now the heartbeat gives
# the slot back when it finds the claim lost.


def test_replay_a_lost_claims_renewed_slot_goes_back(model_env: Env) -> None:
    """test_model's failing example (found in CI on this round), step by step."""
    state = ModelMachine()
    state.seed(focus="mcapped", actors=["a"], then=["a"])
    state.consistent()
    state.work(fate="stall", i=0)
    state.consistent()
    state.world(op="+3")
    state.consistent()
    state.work(fate="beat", i=0)
    state.consistent()
    state.claim(family="focus", fates=["ok"])
    state.teardown()
