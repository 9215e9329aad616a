"""Capped claims: each row claimed takes a Redis slot of its actor while the candidates are
locked, and a row whose actor is at its cap is set waiting instead (see claimer.py)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace

from outbox_dispatch.caps.semaphore import Caps, CapsIncomplete, CapsUnavailable, Slot
from outbox_dispatch.core.errors import DatabaseError
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import Candidate, CapRule, Family, plan_capped_claim
from outbox_dispatch.core.rows import CappedDecision, ClaimResult, LapsedHolder
from outbox_dispatch.store import Store

log = logging.getLogger(__name__)

CapRuleOf = Callable[[Family, str, str | None], CapRule | None]

# Tokens of lapsed holders a claimer remembers per family as given back (claim_lapsed_holders
# reads every one at each claim until its row is claimed again).
LAPSED_KEPT = 1000


class CappedClaims:
    """One database's claims of capped families, for its Claimer: that one checks that Redis
    is configured, rebuilds lost cap semaphores and passes its ``caps`` with each claim."""

    def __init__(self, store: Store, cap_rule: CapRuleOf, caps_database: str | None) -> None:
        self.store = store
        self.cap_rule = cap_rule
        self.caps_database = caps_database  # its freed-slot keys
        # family -> tokens of lapsed holders whose slots this claimer gave back (the latest
        # LAPSED_KEPT): a lapsed row stays so until it is claimed again, and each claim of its
        # family reads it again; its slot goes back once
        self._lapsed_released: dict[str, dict[uuid.UUID, None]] = {}

    def claim(self, family: Family, batch: int, caps: Caps) -> ClaimResult:
        """Claim up to ``batch`` due rows of the family, each capped row taking a slot of its
        actor (one at its cap: the row is set waiting); raises CapsIncomplete when Redis lost
        the cap semaphores."""
        taken: dict[int, Slot] = {}  # row id -> the slot granted for it
        wake = False  # lapsed holders' slots freed: their actors' waiting rows are due

        rules: dict[str, CapRule | None] = {}  # command -> its rule for a row with an actor

        def rule(c: Candidate) -> CapRule | None:
            if c.actor is None:
                return None
            try:
                return rules[c.command]
            except KeyError:
                found = rules[c.command] = self.cap_rule(family, c.command, c.actor)
                return found

        def decide(
            candidates: list[Candidate], limit: int, lapsed: list[LapsedHolder]
        ) -> CappedDecision:
            nonlocal wake
            wake |= self._release_lapsed(family, lapsed, caps)
            plan = plan_capped_claim(candidates, rule, limit)
            tokens = {c.id: uuid.uuid4() for c in plan.take}
            capped = [(c, r) for c in plan.take if (r := rule(c)) is not None]
            slots = [
                Slot(family.name, c.actor or "", tokens[c.id], r.limit, r.scope) for c, r in capped
            ]
            wait = [c.id for c in plan.wait]
            try:
                granted = caps.acquire_many(slots, family.lease, waiting=bool(plan.wait))
            except CapsIncomplete:
                caps.release_many(slots)
                raise
            except CapsUnavailable as exc:
                # Redis is down: capped rows stay due in Postgres and are tried again next
                # pass; rows without an actor still go out.
                event(log, logging.WARNING, "caps_unavailable", str(exc), family=family.name)
                granted = [False] * len(slots)
                wait = []
            else:
                wait += [c.id for (c, _), ok in zip(capped, granted, strict=True) if not ok]
            refused = {c.id for (c, _), ok in zip(capped, granted, strict=True) if not ok}
            taken.update(
                {c.id: s for (c, _), s, ok in zip(capped, slots, granted, strict=True) if ok}
            )
            return [(c.id, tokens[c.id]) for c in plan.take if c.id not in refused], wait

        try:  # also checks for a Redis restarted from an old snapshot, which lost holders
            freed = caps.take_freed(family.name, self.caps_database)
        except CapsUnavailable:  # Redis down: the claim still sends rows without an actor
            freed = {}
        try:
            result = self.store.claim_capped(family, batch, decide, freed)
        except BaseException:
            caps.release_many(list(taken.values()))  # the claim rolled back: give slots back
            caps.give_back_freed(family.name, freed, self.caps_database)
            raise
        # rows parked at claim (their last attempt was lost) do not keep the slot they took
        caps.release_many([taken[i] for i in result.parked if i in taken])
        if wake:
            with contextlib.suppress(DatabaseError):  # else beat's next pass claims them
                self.store.request_claim(family.name)
        return replace(result, freed=sum(freed.values())) if freed else result

    def _release_lapsed(self, family: Family, lapsed: list[LapsedHolder], caps: Caps) -> bool:
        """Give back the slots of started attempts whose lease ran out, before this claim takes
        slots: a start leaves a young claim's slot to run to the claim's lease (worker/slots.py),
        so a killed worker's slots end here, with their rows' leases, not a lease later. The
        release notes each freed slot, as a settle's does, so the actor's waiting rows come
        in with the next claim (True: the caller asks for it, once this one committed)."""
        seen = self._lapsed_released.setdefault(family.name, {})
        slots = []
        for h in lapsed:
            if h.token in seen:
                continue
            r = self.cap_rule(family, h.command, h.actor)
            if r is not None:
                slots.append(Slot(family.name, h.actor, h.token, r.limit, r.scope))
        if not slots:
            return False
        try:
            woken = caps.release_lapsed(slots, self.caps_database)
        except CapsUnavailable as exc:  # tried again by the next claim
            event(log, logging.WARNING, "caps_unavailable", str(exc), family=family.name)
            return False
        for s in slots:
            seen[s.token] = None
        for token in list(seen)[: max(0, len(seen) - LAPSED_KEPT)]:
            del seen[token]
        event(
            log,
            logging.WARNING,
            "cap_slots_reclaimed",
            f"{len(slots)} cap slots of started attempts whose lease ran out (worker died or "
            "stalled) given back, those no heartbeat still renews",
            family=family.name,
            actors=sorted({s.actor for s in slots}),
        )
        return woken
