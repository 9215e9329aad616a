"""Runs one claimed row: check the claim, run the handler, settle fenced by the claim token,
then give back the row's cap slot and let the actor's next waiting row in."""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from uuid import UUID

from .caps import Caps, CapsUnavailable
from .errors import PermanentFailure
from .handlers import Context, Registry
from .logs import event
from .policy import Family, Verdict, decide_failure
from .store import Started, Store

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 4000


class Outcome(StrEnum):
    DELIVERED = "delivered"
    RETRIED = "retried"
    PARKED = "parked"
    STALE = "stale"
    LOST = "lost"  # settled by nobody: the token no longer held when the handler ended


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    row_id: int | None
    detail: str = ""


def parse_message(args: tuple[Any, ...]) -> tuple[int, UUID] | None:
    """A delivery message is exactly (row id, claim token); anything else is garbage."""
    if len(args) != 2:
        return None
    row_id, token = args
    if isinstance(row_id, bool) or not isinstance(row_id, int) or row_id <= 0:
        return None
    if not isinstance(token, str):
        return None
    try:
        return row_id, UUID(token)
    except ValueError:
        return None


def describe_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[:MAX_ERROR_LENGTH]


class Delivery:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        families: Mapping[str, Family],
        *,
        caps: Caps | None = None,
        is_capped: Callable[[Family], bool] = lambda f: f.per_actor is not None,
        wake: Callable[[str], None] = lambda family: None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.store = store
        self.registry = registry
        self.families = families
        self.caps = caps
        self.is_capped = is_capped
        self.wake = wake
        self.rand = rand

    def deliver_message(self, args: tuple[Any, ...]) -> Result:
        parsed = parse_message(args)
        if parsed is None:
            shown = repr(args)[:200]
            event(log, logging.WARNING, "stale_dropped", f"garbage delivery message {shown}")
            return Result(Outcome.STALE, None, "garbage message")
        return self.deliver(*parsed)

    def deliver(self, row_id: int, token: UUID, *, family_hint: str | None = None) -> Result:
        lease = self._lease_for(family_hint)
        started = self.store.begin(row_id, token, lease)
        if started is None:
            why = self.store.why_stale(row_id, token)
            event(log, logging.INFO, "stale_dropped", why, row_id=row_id)
            return Result(Outcome.STALE, row_id, why)
        family = self.families.get(started.family)
        if family is None:
            return self._park(
                started,
                None,
                f"family {started.family!r} is not declared in this worker: "
                "declare it with dispatcher.family() and retry the parked row",
            )
        if not self._slot_still_held(started, family):
            return Result(Outcome.STALE, row_id, "cap slot lapsed")
        fn = self.registry.handler(started.command)
        if fn is None:
            return self._park(
                started,
                family,
                f"no handler for command {started.command!r} in this worker: "
                "register it with @dispatcher.handler and run `outbox-dispatch parked retry`",
            )
        ctx = Context(
            row_id=started.id,
            family=started.family,
            command=started.command,
            actor=started.actor,
            attempt=started.attempts,
            idempotency_key=started.dedupe_key or f"outbox:{started.id}",
            maybe_applied=started.maybe_applied,
            _renew=lambda: self._renew(started, family),
        )
        fields = _fields(started)
        event(log, logging.DEBUG, "handler_started", "running handler", **fields)
        t0 = time.perf_counter()
        try:
            fn(ctx, started.payload)
        except PermanentFailure as exc:
            return self._park(started, family, describe_error(exc))
        except Exception as exc:
            return self._failed(started, family, exc)
        elapsed = time.perf_counter() - t0
        kind = "done" if family.retention > 0 else "delete"
        if self._settle(kind, started, family):
            event(
                log, logging.INFO, "delivered", f"handler ok in {elapsed * 1000:.1f} ms", **fields
            )
            return Result(Outcome.DELIVERED, started.id)
        return self._lost(started)

    # -- leases and slots -------------------------------------------------------------------

    def _lease_for(self, family_hint: str | None) -> float:
        # The begin statement renews the lease before the row's family is known; the queue the
        # message came from names it, else the longest lease is the safe choice.
        if family_hint and family_hint in self.families:
            return self.families[family_hint].lease
        return max(f.lease for f in self.families.values())

    def _capped(self, started: Started, family: Family) -> bool:
        return self.caps is not None and started.actor is not None and self.is_capped(family)

    def _slot_still_held(self, started: Started, family: Family) -> bool:
        """A capped row may only start while its slot is live: if the slot lapsed, another row
        of the actor may hold it now, so the row goes back, due, uncounted."""
        if not self._capped(started, family):
            return True
        assert self.caps is not None
        assert started.actor is not None
        try:
            state = self.caps.renew(started.family, started.actor, started.token, family.lease)
        except CapsUnavailable as exc:
            # The row's lease is live in Postgres, so its slot was live when Redis went away; a
            # rebuild restores it from that lease.
            event(log, logging.WARNING, "caps_unavailable", str(exc), **_fields(started))
            return True
        if state == 0:
            self.store.handback(started.id, started.token)
            event(
                log,
                logging.WARNING,
                "cap_slot_lapsed",
                "the row's cap slot expired before delivery began; row handed back",
                **_fields(started),
            )
            return False
        return True

    def _renew(self, started: Started, family: Family) -> bool:
        alive = self.store.renew(started.id, started.token, family.lease)
        if alive and self._capped(started, family):
            assert self.caps is not None
            assert started.actor is not None
            try:
                self.caps.renew(started.family, started.actor, started.token, family.lease)
            except CapsUnavailable as exc:
                event(log, logging.WARNING, "caps_unavailable", str(exc), **_fields(started))
        return alive

    # -- settling ---------------------------------------------------------------------------

    def _settle(
        self,
        kind: str,
        started: Started,
        family: Family | None,
        *,
        delay: float = 0.0,
        error: str | None = None,
    ) -> bool:
        """Settle fenced by the token; then free the cap slot and let one waiting row in."""
        if family is not None and family.ordered and started.actor is not None:
            ok = self.store.settle_in_line(
                kind,
                started.id,
                started.token,
                family=family.name,
                actor=started.actor,
                parked_blocks=family.parked_blocks,
                delay=delay,
                error=error,
            )
        else:
            ok = self.store.settle(kind, started.id, started.token, delay=delay, error=error)
        if family is not None and self._capped(started, family):
            assert self.caps is not None
            assert started.actor is not None
            # release only after the settle: the slot covers the row until it is settled; the
            # claimer then lets one waiting row of the actor in
            if self.caps.release(started.family, started.actor, started.token):
                self.wake(started.family)
        return ok

    def _failed(self, started: Started, family: Family, exc: Exception) -> Result:
        error = describe_error(exc)
        decision = decide_failure(family, started.attempts, self.rand())
        if decision.verdict is Verdict.PARK:
            return self._park(started, family, error)
        if self._settle("retry", started, family, delay=decision.delay, error=error):
            event(
                log,
                logging.WARNING,
                "retried",
                f"handler failed, due again in {decision.delay:.1f} s: {error}",
                **_fields(started),
            )
            return Result(Outcome.RETRIED, started.id, error)
        return self._lost(started)

    def _park(self, started: Started, family: Family | None, error: str) -> Result:
        if self._settle("park", started, family, error=error):
            event(
                log,
                logging.ERROR,
                "parked",
                f"row parked: {error} (inspect with `outbox-dispatch parked list`)",
                **_fields(started),
            )
            return Result(Outcome.PARKED, started.id, error)
        return self._lost(started)

    def _lost(self, started: Started) -> Result:
        event(
            log,
            logging.WARNING,
            "settle_refused",
            "the claim no longer holds (lease ran out and the row was claimed again); "
            "the result of this attempt is discarded",
            **_fields(started),
        )
        return Result(Outcome.LOST, started.id)


def _fields(s: Started) -> dict[str, Any]:
    return {
        "row_id": s.id,
        "family": s.family,
        "command": s.command,
        "actor": s.actor,
        "attempt": s.attempts,
    }
