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

from . import metrics, tracing
from .caps import Caps, CapsUnavailable
from .errors import PermanentFailure
from .handlers import Context, HandlerFn, Registration, Registry
from .heartbeat import Heartbeats, Running
from .logs import event, mask_dsn
from .policy import Family, Verdict, decide_failure
from .settler import Settler
from .store import Conn, Started, Store

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 4000


class Outcome(StrEnum):
    DELIVERED = "delivered"
    RETRIED = "retried"
    PARKED = "parked"
    CANCELLED = "cancelled"
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


MAX_BATCH = 1000


def parse_batch(args: tuple[Any, ...]) -> list[tuple[int, UUID]] | None:
    """A batched message is one list of [row id, claim token] pairs."""
    if len(args) != 1 or not isinstance(args[0], list) or not 0 < len(args[0]) <= MAX_BATCH:
        return None
    pairs = []
    for item in args[0]:
        pair = parse_message(tuple(item)) if isinstance(item, list | tuple) else None
        if pair is None:
            return None
        pairs.append(pair)
    return pairs


class _Cancelled(Exception):
    """Unwinds a transactional handler's transaction when its row was cancelled."""


def describe_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return mask_dsn(text)[:MAX_ERROR_LENGTH]  # a handler's own DB error may quote its URL


class Delivery:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        families: Mapping[str, Family],
        *,
        caps: Caps | None = None,
        cap_of: Callable[[Family, str], int | None] = lambda family, command: family.per_actor,
        wake: Callable[[str], None] = lambda family: None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.store = store
        self.registry = registry
        self.families = families
        self.caps = caps
        self.cap_of = cap_of
        self.wake = wake
        self.rand = rand
        self.heartbeats = Heartbeats(store)
        self.settler = Settler(store, self._settle_refused)

    def deliver_message(
        self, args: tuple[Any, ...], *, family_hint: str | None = None, defer: bool = False
    ) -> list[Result]:
        """Deliver what a broker message names: one (id, token) pair or a batch of them.
        ``defer``: a worker hands eligible successes to the settler (see settler.py)."""
        pair = parse_message(args)
        pairs = parse_batch(args) if pair is None else None
        if pair is not None:
            results = [self.deliver(*pair, family_hint=family_hint, defer=defer)]
        elif pairs is not None:
            results = self.deliver_batch(pairs, family_hint=family_hint)
        else:
            shown = repr(args)[:200]
            event(log, logging.WARNING, "stale_dropped", f"garbage delivery message {shown}")
            results = [Result(Outcome.STALE, None, "garbage message")]
        for r in results:
            metrics.outcome(family_hint, r.outcome.value)
        return results

    def deliver_batch(
        self, pairs: list[tuple[int, UUID]], *, family_hint: str | None = None
    ) -> list[Result]:
        """A batched message: start every row in one statement, run the handlers one after
        another, settle the successes in one statement (failures, cancels and transactional
        rows settle one by one). If the worker dies mid-batch, every unsettled row of the
        batch counts as started: its next attempt runs with maybe_applied set."""
        started = self.store.begin_many(pairs, self._lease_for(family_hint))
        began = {s.id for s in started}
        results = [
            Result(Outcome.STALE, row_id, "stale in batch")
            for row_id, _ in pairs
            if row_id not in began
        ]
        if results:
            event(log, logging.INFO, "stale_dropped", f"{len(results)} stale rows in a batch")
        entries: list[tuple[Started, Registration, Running]] = []
        for s in started:
            family = self.families.get(s.family)
            reg = self.registry.registration(s.command)
            if family is None or reg is None or reg.fn is None or s.cancel_requested:
                results.append(self._start_checked(s, family))
                continue
            _ctx, running = self._context(s, family, reg.transactional)
            running.deadline = None  # each row's time limit starts with its own handler
            self.heartbeats.add(running)
            entries.append((s, reg, running))
        done: list[Started] = []
        try:
            for s, reg, running in entries:
                family = self.families[s.family]
                assert reg.fn is not None
                metrics.started(s.family, s.waited)
                t0 = time.perf_counter()
                running.deadline = _deadline(family)
                with tracing.delivery_span(s) as span:
                    span.set_attribute("outbox.batch", True)
                    result = self._run_in_batch(s, family, reg, running.ctx)
                    if result is None:
                        done.append(s)
                    else:
                        results.append(result)
                        tracing.finish(span, result.outcome.value, result.detail)
                metrics.handled(s.family, s.command, time.perf_counter() - t0)
            results += self._settle_successes(done)
        finally:
            for s, _, _ in entries:
                self.heartbeats.remove(s.id)
        return results

    def _run_in_batch(
        self, s: Started, family: Family, reg: Registration, ctx: Context
    ) -> Result | None:
        """One row of a batch; None when its handler succeeded (settled with the others)."""
        assert reg.fn is not None
        if reg.transactional:
            return self._run_in_transaction(s, family, reg.fn, ctx)
        try:
            reg.fn(ctx, s.payload)
        except PermanentFailure as exc:
            return self._park(s, family, describe_error(exc))
        except Exception as exc:
            return self._failed(s, family, exc)
        return None

    def _settle_successes(self, done: list[Started]) -> list[Result]:
        results: list[Result] = []
        by_kind: dict[str, list[Started]] = {}
        for s in done:
            kind = "done" if self.families[s.family].retention > 0 else "delete"
            by_kind.setdefault(kind, []).append(s)
        for kind, rows in by_kind.items():
            settled = self.store.settle_many(kind, [(s.id, s.token) for s in rows])
            for s in rows:
                if s.id in settled:
                    event(log, logging.INFO, "delivered", "handler ok (batch)", **_fields(s))
                    results.append(Result(Outcome.DELIVERED, s.id))
                else:  # a cancel request arrived, or the claim was lost
                    results.append(self._succeeded(s, self.families[s.family], 0.0))
        return results

    def _start_checked(self, started: Started, family: Family | None) -> Result:
        """The checks before a handler runs, for rows that fail them."""
        if family is None:
            return self._park(
                started,
                None,
                f"family {started.family!r} is not declared in this worker: "
                "declare it with dispatcher.family() and retry the parked row",
            )
        if started.cancel_requested:  # cancelled while on its way here: never runs
            return self._cancelled(started, family)
        return self._park(
            started,
            family,
            f"no handler for command {started.command!r} in this worker: "
            "register it with @dispatcher.handler and run `outbox-dispatch parked retry`",
        )

    def _context(
        self, started: Started, family: Family, transactional: bool
    ) -> tuple[Context, Running]:
        ctx = Context(
            row_id=started.id,
            family=started.family,
            command=started.command,
            actor=started.actor,
            attempt=started.attempts,
            idempotency_key=started.dedupe_key or f"outbox:{started.id}",
            maybe_applied=started.maybe_applied,
            _beat=lambda progress: self.heartbeats.beat_now(started.id, progress),
        )
        running = Running(
            ctx=ctx,
            token=started.token,
            lease=family.lease,
            transactional=transactional,
            renew_slot=self._slot_renewer(started, family),
            next_at=time.monotonic() + family.lease / 3,
            deadline=_deadline(family),
        )
        return ctx, running

    def deliver(
        self, row_id: int, token: UUID, *, family_hint: str | None = None, defer: bool = False
    ) -> Result:
        lease = self._lease_for(family_hint)
        started = self.store.begin(row_id, token, lease)
        if started is None:
            why = self.store.why_stale(row_id, token)
            event(log, logging.INFO, "stale_dropped", why, row_id=row_id)
            return Result(Outcome.STALE, row_id, why)
        family = self.families.get(started.family)
        if family is not None and not self._slot_still_held(started, family):
            return Result(Outcome.STALE, row_id, "cap slot lapsed")
        reg = self.registry.registration(started.command)
        if family is None or reg is None or reg.fn is None or started.cancel_requested:
            return self._start_checked(started, family)
        ctx, running = self._context(started, family, reg.transactional)
        self.heartbeats.add(running)
        metrics.started(started.family, started.waited)
        t0 = time.perf_counter()
        with tracing.delivery_span(started) as span:
            try:
                if reg.transactional:
                    result = self._run_in_transaction(started, family, reg.fn, ctx)
                else:
                    result = self._run(started, family, reg.fn, ctx, defer=defer)
            finally:
                self.heartbeats.remove(started.id)
                metrics.handled(started.family, started.command, time.perf_counter() - t0)
            tracing.finish(span, result.outcome.value, result.detail)
        return result

    def _run(
        self, started: Started, family: Family, fn: HandlerFn, ctx: Context, *, defer: bool
    ) -> Result:
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
        if defer and not family.ordered and not self._capped(started, family):
            # nothing waits on this settle (no cap slot, no ordered line): off the hot path
            self.settler.add("done" if family.retention > 0 else "delete", started)
            event(
                log,
                logging.INFO,
                "delivered",
                f"handler ok in {elapsed * 1000:.1f} ms (settle batched)",
                **_fields(started),
            )
            return Result(Outcome.DELIVERED, started.id)
        return self._succeeded(started, family, elapsed)

    def _settle_refused(self, kind: str, started: Started) -> None:
        """A deferred settle the batch statement skipped: a cancel request arrived, or the
        claim was lost; the one-row path records which."""
        self._succeeded(started, self.families.get(started.family) or Family(started.family), 0)

    def _run_in_transaction(
        self, started: Started, family: Family, fn: HandlerFn, ctx: Context
    ) -> Result:
        """The handler's writes and the row's settle commit together, under the row's lock,
        or not at all: exactly-once effects for work that stays in Postgres."""
        t0 = time.perf_counter()
        try:
            with self.store.locked_row(started.id, started.token) as held:
                if held is None:
                    return self._lost(started)
                conn, cancel = held
                if cancel:
                    raise _Cancelled()
                ctx.conn = conn
                fn(ctx, started.payload)
                kind = "done" if family.retention > 0 else "delete"
                settled = self._settle(
                    kind, started, family, conn=conn, release=False, or_cancel=False
                )
                if not settled:
                    raise _Cancelled()  # a cancel request arrived: undo the handler's writes
        except _Cancelled:
            return self._cancelled(started, family)
        except PermanentFailure as exc:
            return self._park(started, family, describe_error(exc))
        except Exception as exc:
            return self._failed(started, family, exc)
        finally:
            ctx.conn = None
        self._release(started, family)
        event(
            log,
            logging.INFO,
            "delivered",
            f"transactional handler committed in {(time.perf_counter() - t0) * 1000:.1f} ms",
            **_fields(started),
        )
        return Result(Outcome.DELIVERED, started.id)

    def _succeeded(self, started: Started, family: Family, elapsed: float) -> Result:
        kind = "done" if family.retention > 0 else "delete"
        applied = self._settle(kind, started, family)
        if applied == "cancel":
            return self._was_cancelled(started)
        if applied:
            event(
                log,
                logging.INFO,
                "delivered",
                f"handler ok in {elapsed * 1000:.1f} ms",
                **_fields(started),
            )
            return Result(Outcome.DELIVERED, started.id)
        return self._lost(started)

    def _cancelled(self, started: Started, family: Family) -> Result:
        if self._settle("cancel", started, family):
            return self._was_cancelled(started)
        return self._lost(started)

    def _was_cancelled(self, started: Started) -> Result:
        event(log, logging.INFO, "cancelled", "row settled as cancelled", **_fields(started))
        return Result(Outcome.CANCELLED, started.id)

    # -- leases and slots -------------------------------------------------------------------

    def _lease_for(self, family_hint: str | None) -> float:
        # The begin statement renews the lease before the row's family is known; the queue the
        # message came from names it, else the longest lease is the safe choice.
        if family_hint and family_hint in self.families:
            return self.families[family_hint].lease
        return max(f.lease for f in self.families.values())

    def _capped(self, started: Started, family: Family) -> bool:
        """Whether this row took a cap slot: an actor, and a cap for its command (a family may
        cap some commands and not others)."""
        return (
            self.caps is not None
            and started.actor is not None
            and not family.ordered
            and self.cap_of(family, started.command) is not None
        )

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
            # Without Redis the slot cannot be checked: the row goes back and waits in Postgres.
            self.store.handback(started.id, started.token)
            event(
                log,
                logging.WARNING,
                "caps_unavailable",
                f"{exc}; row handed back",
                **_fields(started),
            )
            return False
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

    def _slot_renewer(self, started: Started, family: Family) -> Callable[[], bool] | None:
        """Renews the row's cap slot; False when the slot lapsed (another row of the actor may
        hold it now), which tells the handler to stop."""
        if not self._capped(started, family):
            return None
        caps, actor = self.caps, started.actor
        assert caps is not None
        assert actor is not None

        def renew() -> bool:
            try:
                return caps.renew(started.family, actor, started.token, family.lease) != 0
            except CapsUnavailable as exc:
                event(log, logging.WARNING, "caps_unavailable", str(exc), **_fields(started))
                return True  # unknown: the Postgres lease still fences the settle

        return renew

    # -- settling ---------------------------------------------------------------------------

    def _settle(
        self,
        kind: str,
        started: Started,
        family: Family | None,
        *,
        delay: float = 0.0,
        error: str | None = None,
        conn: Conn | None = None,
        release: bool = True,
        or_cancel: bool = True,
    ) -> str | None:
        """Settle fenced by the token (a pending cancel request wins); then free the cap slot
        so the claimer lets one waiting row of the actor in."""
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
                conn=conn,
                or_cancel=or_cancel,
            )
        else:
            ok = self.store.settle(
                kind,
                started.id,
                started.token,
                delay=delay,
                error=error,
                conn=conn,
                or_cancel=or_cancel,
            )
        if release:
            self._release(started, family)
        return ok

    def _release(self, started: Started, family: Family | None) -> None:
        # only after the settle committed: the slot covers the row until it is settled
        if family is not None and self._capped(started, family):
            assert self.caps is not None
            assert started.actor is not None
            if self.caps.release(started.family, started.actor, started.token):
                self.wake(started.family)

    def _failed(self, started: Started, family: Family, exc: Exception) -> Result:
        error = describe_error(exc)
        if type(exc).__name__ == "SoftTimeLimitExceeded":  # billiard's, raised by prefork
            error = (
                f"handler ran past the family's time_limit of {family.time_limit:g} s and was "
                "interrupted; make it faster, or raise time_limit"
            )
        decision = decide_failure(family, started.attempts, self.rand())
        if decision.verdict is Verdict.PARK:
            return self._park(started, family, error)
        applied = self._settle("retry", started, family, delay=decision.delay, error=error)
        if applied == "cancel":
            return self._was_cancelled(started)
        if applied:
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
        applied = self._settle("park", started, family, error=error)
        if applied == "cancel":
            return self._was_cancelled(started)
        if applied:
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


def _deadline(family: Family) -> float | None:
    """When the heartbeat stops renewing a handler's lease: at the hard limit, so a prefork
    worker kills a handler that swallowed the soft limit before its row can be claimed again."""
    hard = family.hard_time_limit()
    return None if hard is None else time.monotonic() + hard


def _fields(s: Started) -> dict[str, Any]:
    return {
        "row_id": s.id,
        "family": s.family,
        "command": s.command,
        "actor": s.actor,
        "attempt": s.attempts,
    }
