"""A capped row's cap slot in the pool process: checked before the row starts, renewed by its
heartbeats, and given back once its handler returned (a deferred settle) or its row is settled,
so the claimer lets the actor's next row in."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from uuid import UUID

from outbox_dispatch.caps.releases import Wake
from outbox_dispatch.caps.semaphore import RENEW_TIMEOUT, Caps, CapsUnavailable, Slot
from outbox_dispatch.core import timings
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import CapRule, Family
from outbox_dispatch.core.rows import Started
from outbox_dispatch.store import Store
from outbox_dispatch.worker.heartbeat import SlotState
from outbox_dispatch.worker.messages import row_fields

log = logging.getLogger(__name__)

# A heartbeat renews a slot up to two ticks late and may wait RENEW_TIMEOUT for Redis: a slot
# must have this much left past the heartbeat's first renewal to start on without renewing.
SLOT_MARGIN = 2 * timings.HEARTBEAT_TICK + RENEW_TIMEOUT
LAPSED = 0.0  # what CapSlots.check returns for a row whose slot lapsed (handed back)


@dataclass(frozen=True)
class Handed:
    """A row a stopping worker handed back (worker/leaving.py): due again, not started, or
    ``started`` and marked lost."""

    id: int
    family: str
    command: str
    actor: str | None
    token: UUID
    started: bool


def slot_surely_left(claim_age: float | None, family: Family) -> float | None:
    """Seconds a starting row's cap slot is surely still held, from its claim's age: the claim
    took the slot for the family's lease after its transaction began, when ``claimed_at`` was
    set, so at least the lease less that age is left. None when that is too little to start
    on without asking Redis: the heartbeat's first renewal comes a third of the heartbeat
    timeout after the start, and may be SLOT_MARGIN late."""
    if claim_age is None:
        return None
    left = family.lease - max(claim_age, 0.0)
    return left if left >= family.heartbeat_timeout / 3 + SLOT_MARGIN else None


class CapSlots:
    """The cap slots of one database's rows; ``caps_database`` is its wake key (None for the
    first database), and ``on_slot_freed(family, database)`` lets that claimer's waiting row
    in."""

    def __init__(
        self,
        store: Store,
        families: Mapping[str, Family],
        caps: Caps | None,
        cap_rule: Callable[[Family, str, str | None], CapRule | None],
        on_slot_freed: Callable[[str, str | None], None],
        caps_database: str | None,
    ) -> None:
        self.store = store
        self.families = families
        self.caps = caps
        self.cap_rule = cap_rule
        self.on_slot_freed = on_slot_freed
        self.caps_database = caps_database

    def _rule(self, started: Started, family: Family) -> CapRule | None:
        """The cap this row's slot counts against, when it took one: an actor, and a cap for
        its command (a family may cap some commands and not others)."""
        if self.caps is None:
            return None
        return self.cap_rule(family, started.command, started.actor)

    def _slot(self, family: Family, command: str, actor: str | None, token: UUID) -> Slot | None:
        """The cap slot a row of ``family`` holds under ``token``, if its command is capped."""
        rule = None if self.caps is None else self.cap_rule(family, command, actor)
        if rule is None or actor is None:
            return None
        return Slot(family.name, actor, token, rule.limit, rule.scope)

    def _slot_of(self, started: Started) -> Slot | None:
        family = self.families.get(started.family)
        if family is None:
            return None
        return self._slot(family, started.command, started.actor, started.token)

    def check(self, started: Started, family: Family) -> float | None:
        """A capped row may only start while its slot is live: if the slot lapsed, another row
        of the actor may hold it now, so the row goes back, due, uncounted (returns LAPSED). A
        young claim's slot is surely held (``slot_surely_left``): the row starts without a
        word to Redis. Its slot runs on to the claim's lease until the heartbeat's first
        renewal bounds it to the heartbeat timeout; should the worker die before that, the
        family's next claim after the row's lease gives the slot back (claim_lapsed_holders),
        so the handler must stop by then if it cannot renew: the seconds returned are the
        row's lease (the heartbeat timeout), or less if the claim's lease ends sooner. An
        older claim's slot is renewed and waited for (None: a whole heartbeat timeout). None
        too for a row without a cap slot."""
        rule = self._rule(started, family)
        if rule is None:
            return None
        assert self.caps is not None
        assert started.actor is not None
        left = slot_surely_left(started.claim_age, family)
        if left is not None:
            return min(left, family.heartbeat_timeout)
        try:
            state = self.caps.renew(
                started.family, started.actor, started.token, family.heartbeat_timeout, rule.scope
            )
        except CapsUnavailable as exc:
            # Without Redis the slot cannot be checked: the row goes back and waits in Postgres.
            self.store.handback(started.id, started.token)
            event(
                log,
                logging.WARNING,
                "caps_unavailable",
                f"{exc}; row handed back",
                **row_fields(started),
            )
            return LAPSED
        if state == 0:
            self.store.handback(started.id, started.token)
            event(
                log,
                logging.WARNING,
                "cap_slot_lapsed",
                "the row's cap slot expired before delivery began; row handed back",
                **row_fields(started),
            )
            return LAPSED
        return None

    def renewer(
        self, started: Started, family: Family, held: float | None = None
    ) -> Callable[[], SlotState] | None:
        """Renews the row's cap slot. While Redis cannot be reached the slot runs on until its
        last renewal's lease ends, and the row's lease is not renewed past it; a renewal
        before that end that still fails reports the slot LAPSED, so the handler stops before
        the claimer (which may reach Redis) can grant the slot to another row of the actor."""
        rule = self._rule(started, family)
        if rule is None:
            return None
        caps, actor = self.caps, started.actor
        assert caps is not None
        assert actor is not None
        timeout = family.heartbeat_timeout
        # The slot was renewed for a whole timeout just before this runs (an old claim's
        # waited renewal), or is surely ``held`` that long (a young claim's, until its row's
        # lease ends: a claim may give it back then), a third of the timeout and SLOT_MARGIN
        # at least.
        # Renewals start every timeout/3 (give or take a tick) and give up after
        # RENEW_TIMEOUT, so a failure that leaves less than this margin is the last one before
        # the slot's end.
        until = [time.monotonic() + (timeout if held is None else held)]
        margin = timeout / 3 + SLOT_MARGIN

        def renew() -> SlotState:
            t0 = time.monotonic()
            try:
                state = caps.renew(
                    started.family, actor, started.token, timeout, rule.scope, heartbeat=True
                )
            except CapsUnavailable as exc:
                if time.monotonic() + margin >= until[0]:
                    event(
                        log,
                        logging.WARNING,
                        "caps_unavailable",
                        f"{exc}; the slot cannot be renewed before it runs out: stopping",
                        **row_fields(started),
                    )
                    return SlotState.LAPSED
                event(log, logging.WARNING, "caps_unavailable", str(exc), **row_fields(started))
                return SlotState.UNKNOWN
            if state == 0:
                return SlotState.LAPSED
            # 1 renewed; -1 the semaphores are being rebuilt from the live leases in Postgres,
            # ours among them, and no slot is granted until then
            until[0] = t0 + timeout
            return SlotState.HELD

        return renew

    def release(self, started: Started, family: Family | None) -> None:
        # only after the settle committed: the slot covers the row until it is settled
        slot = (
            None
            if family is None
            else self._slot(family, started.command, started.actor, started.token)
        )
        if slot is not None:
            assert self.caps is not None
            if self.caps.release([slot], self.caps_database):
                self.on_slot_freed(slot.family, self.caps_database)  # lets a waiting row in

    def release_returned(self, started: Started) -> None:
        """The slot of a row whose handler returned and whose settle is deferred."""
        if self.caps is not None and (slot := self._slot_of(started)) is not None:
            # a cap counts running handlers: this one returned, so its slot goes back now
            # (the answer, whether to wake the claimer, is read later: caps/releases.py)
            self._woken(self.caps.release_settled([slot], self.caps_database, wait=False))

    def flush(self) -> None:
        """The end of a message: read every answer of the releases sent without waiting, so
        that a freed slot's wake does not wait for this process's next message (a no-op when
        nothing is unread)."""
        if self.caps is not None:
            self._woken(self.caps.release_settled([], self.caps_database, wait=True))

    def _woken(self, wakes: set[Wake]) -> None:
        """Release answers said these claimers (family, database) should let a waiting row
        in: a process's releases of every database ride together, so some may be another
        database's."""
        for family_name, database in sorted(wakes, key=lambda w: (w[0], w[1] or "")):
            self.on_slot_freed(family_name, database)

    def handed_back(self, rows: Sequence[Handed]) -> None:
        """Rows a stopping worker handed back are due now: their cap slots go back (the next
        claim takes a slot again, for them or for their actors' waiting rows), and each family's
        claimer is asked for a claim at once, not at its next pass."""
        freed: dict[str, list[Slot]] = {}
        for row in rows:
            family = self.families.get(row.family)
            slot = None if family is None else self._slot(family, row.command, row.actor, row.token)
            freed.setdefault(row.family, []).extend([] if slot is None else [slot])
        for family_name, slots in sorted(freed.items()):
            if slots and self.caps is not None:
                self.caps.release(slots, self.caps_database)
            self.on_slot_freed(family_name, self.caps_database)
