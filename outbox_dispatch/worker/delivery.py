"""Runs one claimed row: check the claim, run the handler, settle fenced by the claim token,
then give back the row's cap slot and let the actor's next waiting row in."""

from __future__ import annotations

import inspect
import logging
import random
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from outbox_dispatch.caps.releases import Wake
from outbox_dispatch.caps.semaphore import RENEW_TIMEOUT, Caps, CapsUnavailable, Slot
from outbox_dispatch.claim.runstats import RunTimes
from outbox_dispatch.core import timings
from outbox_dispatch.core.errors import (
    DatabaseError,
    PermanentFailure,
    RetryLater,
    StatementCancelled,
)
from outbox_dispatch.core.handlers import Context, HandlerFn, Registry
from outbox_dispatch.core.logs import event, mask_dsn
from outbox_dispatch.core.policy import CapRule, Family, cap_rule
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import (
    Outcome,
    Settle,
    SettleKind,
    StopReason,
    after_failure,
    after_return,
    delivered,
    outcome,
    retry_asked,
    stop_error,
)
from outbox_dispatch.observe import metrics, tracing
from outbox_dispatch.store import Store
from outbox_dispatch.store.pool import Conn
from outbox_dispatch.worker.deferred_settles import DeferredSettles, carried
from outbox_dispatch.worker.heartbeat import Heartbeats, Running, SlotState

log = logging.getLogger(__name__)

MAX_ERROR_LENGTH = 4000
# A heartbeat renews a slot up to two ticks late and may wait RENEW_TIMEOUT for Redis: a slot
# must have this much left past the heartbeat's first renewal to start on without renewing.
SLOT_MARGIN = 2 * timings.HEARTBEAT_TICK + RENEW_TIMEOUT
LAPSED = 0.0  # what Delivery._check_slot returns for a row whose slot lapsed (handed back)


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    row_id: int | None
    detail: str = ""  # the error of a retried or parked attempt, why a message was stale
    due_in: float | None = None  # retried: seconds until the row is due again


def _cancelled(exc: StatementCancelled, row_id: int, family: str | None) -> Result:
    """A row whose start or settle the server cancelled (its lock_timeout while the
    application held the row locked, its statement_timeout): the row keeps its claim, and its
    lease brings it back (an attempt that started is then a lost one)."""
    event(
        log,
        logging.WARNING,
        "delivery_cancelled",
        f"{exc}; the row is claimed again after its lease",
        row_id=row_id,
        family=family,
    )
    return Result(Outcome.STALE, row_id, str(exc))


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


class _Stopped(Exception):
    """Unwinds a transactional handler's transaction when it returned after being told to
    stop: its writes are rolled back and the row is retried."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


def describe_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return mask_dsn(text)[:MAX_ERROR_LENGTH]  # a handler's own DB error may quote its URL


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


class Delivery:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        families: Mapping[str, Family],
        *,
        caps: Caps | None = None,
        cap_rule: Callable[[Family, str, str | None], CapRule | None] = (
            lambda family, command, actor: cap_rule(family, command, None, actor)
        ),
        # (family, database: None for the first) whose claimer lets a waiting row in
        on_slot_freed: Callable[[str, str | None], None] = lambda family, database: None,
        rand: Callable[[], float] = random.random,
        run_times: RunTimes | None = None,
        database: str = "default",
        primary: bool = True,
    ) -> None:
        self.store = store
        self.database = database  # its name, in metrics
        self.caps_database = None if primary else database  # its wake key
        self.registry = registry
        self.families = families
        self.caps = caps
        self.cap_rule = cap_rule
        self.on_slot_freed = on_slot_freed
        self.rand = rand
        self.run_times = run_times
        self.heartbeats = Heartbeats(store)
        self.deferred = DeferredSettles(store, self._settle_refused)

    def deliver_message(
        self,
        args: tuple[Any, ...],
        *,
        family_hint: str | None = None,
        defer: bool = False,
        stop_at: float | None = None,
    ) -> list[Result]:
        """Deliver what a broker message names: one (id, token) pair or a batch of them.
        ``defer``: a worker hands eligible successes to the deferred settles. ``stop_at``:
        when Celery's soft time limit for the message fires (monotonic, ``wiring.soft_limit_at``);
        a handler still running then did not return on its own, whatever it does with it."""
        pair = parse_message(args)
        pairs = parse_batch(args) if pair is None else None
        if pair is not None:
            try:
                results = [
                    self.deliver(*pair, family_hint=family_hint, defer=defer, stop_at=stop_at)
                ]
            except StatementCancelled as exc:
                results = [_cancelled(exc, pair[0], family_hint)]
        elif pairs is not None:
            results = self.deliver_batch(
                pairs, family_hint=family_hint, defer=defer, stop_at=stop_at
            )
        else:
            shown = repr(args)[:200]
            event(log, logging.WARNING, "stale_dropped", f"garbage delivery message {shown}")
            results = [Result(Outcome.STALE, None, "garbage message")]
        self._flush_slot_writes()
        for r in results:
            metrics.outcome(family_hint, r.outcome.value, self.database)
        return results

    def deliver_batch(
        self,
        pairs: list[tuple[int, UUID]],
        *,
        family_hint: str | None = None,
        defer: bool = False,
        stop_at: float | None = None,
    ) -> list[Result]:
        """A batched message: its rows one after another, each exactly as if it had come in a
        message of its own (its own start, attempt, time limit, cap slot, settle).

        Each row starts just before its handler runs, so a worker killed mid-batch leaves only
        the row it was running marked started (that one runs again with maybe_applied); the
        rows after it never began, and run when the broker redelivers the message, or are
        claimed again, uncounted, after their lease."""
        family = self.families.get(family_hint or "")
        hard = None if family is None else family.hard_time_limit()
        # Celery's hard limit for the message is the rows' limits added up (publisher.py): a
        # row past its own hard limit keeps its lease until then, when the pool process is
        # killed, so no second copy of it can start while it still runs.
        until = None if hard is None else time.monotonic() + hard * len(pairs)
        results: list[Result] = []
        for row_id, token in pairs:
            try:
                results.append(
                    self.deliver(
                        row_id,
                        token,
                        family_hint=family_hint,
                        defer=defer,
                        renew_until=until,
                        stop_at=stop_at,
                    )
                )
            except StatementCancelled as exc:  # the database answers: the rows after it run
                results.append(_cancelled(exc, row_id, family_hint))
            except DatabaseError as exc:
                # the database went down mid-message (or refuses this process's statements):
                # the rows not started are claimed again after their lease, and the finished
                # ones are still settled below; each row after it would wait for the same pool
                rest = pairs[len(results) :]
                results += [Result(Outcome.STALE, i, str(exc)) for i, _ in rest]
                break
            except Exception as exc:
                if type(exc).__name__ == "SoftTimeLimitExceeded":  # the message's own limit
                    raise
                # one row's failure (a bug of ours, a value we did not foresee) is that row's:
                # if it started, it is a lost attempt, run again after its heartbeat timeout;
                # the rows after it still run now, not after their lease
                event(
                    log,
                    logging.ERROR,
                    "delivery_failed",
                    f"{exc!r}; the rest of the message goes on",
                    row_id=row_id,
                    family=family_hint,
                )
                results.append(Result(Outcome.LOST, row_id, repr(exc)))
        if defer:
            # settle the message's successes before the next message: a handler of the next
            # one that kills the process must not take finished rows with it (they would run
            # again, flagged maybe_applied); one statement per message, not per row
            self.deferred.flush()
        self._flush_slot_writes()
        return results

    def _start_checked(self, started: Started, family: Family | None) -> Result:
        """The checks before a handler runs, for rows that fail them."""
        if family is None:
            error = (
                f"family {started.family!r} is not declared in this worker: "
                "declare it with dispatcher.family() and retry the parked row"
            )
            return self._finish(started, None, Settle(SettleKind.PARK, error=error))
        if started.cancel_requested:  # cancelled while on its way here: never runs
            return self._finish(started, family, Settle(SettleKind.CANCEL))
        error = (
            f"no handler for command {started.command!r} in this worker: "
            "register it with @dispatcher.handler and run `outbox-dispatch parked retry`"
        )
        return self._finish(started, family, Settle(SettleKind.PARK, error=error))

    def _context(
        self,
        started: Started,
        family: Family,
        renew_until: float | None = None,
        held: float | None = None,
        stop_at: float | None = None,
    ) -> tuple[Context, Running]:
        """``held``: seconds the row's cap slot is surely held from now (None: a whole
        heartbeat timeout, as a renewal just gave it)."""
        key = (started.id, started.token)
        ctx = Context(
            row_id=started.id,
            family=started.family,
            command=started.command,
            actor=started.actor,
            attempt=started.attempts,
            idempotency_key=started.dedupe_key or f"outbox:{started.id}",
            maybe_applied=started.maybe_applied,
            database=self.database,
            _beat=lambda progress: self.heartbeats.beat_now(key, progress),
        )
        soft, hard = _deadlines(family)
        if hard is not None and renew_until is not None:
            hard = max(hard, renew_until)
        if stop_at is not None:
            soft = stop_at if soft is None else min(soft, stop_at)
        running = Running(
            ctx=ctx,
            token=started.token,
            run_lease=family.heartbeat_timeout,
            renew_slot=self._slot_renewer(started, family, held),
            next_at=time.monotonic() + family.heartbeat_timeout / 3,
            soft_deadline=soft,
            deadline=hard,
        )
        return ctx, running

    def deliver(
        self,
        row_id: int,
        token: UUID,
        *,
        family_hint: str | None = None,
        defer: bool = False,
        renew_until: float | None = None,
        stop_at: float | None = None,
    ) -> Result:
        if stop_at is not None and time.monotonic() >= stop_at:
            # the message's time limit has passed (a row before it ran long): this row
            # does not start, and is due again at once, uncounted
            self.store.give_back_claim([(row_id, token)])
            why = "not started: the message's time limit had passed"
            event(log, logging.INFO, "stale_dropped", why, row_id=row_id, family=family_hint)
            return Result(Outcome.STALE, row_id, why)
        started = self._start(row_id, token, family_hint)
        family = None if started is None else self.families.get(started.family)
        held = None if started is None or family is None else self._check_slot(started, family)
        if started is None:
            why = self.store.why_stale(row_id, token)
            event(log, logging.INFO, "stale_dropped", why, row_id=row_id)
            return Result(Outcome.STALE, row_id, why)
        if held == LAPSED:
            return Result(Outcome.STALE, row_id, "cap slot lapsed")
        reg = self.registry.registration(started.command)
        if family is None or reg is None or reg.fn is None or started.cancel_requested:
            return self._start_checked(started, family)
        _ctx, running = self._context(started, family, renew_until, held, stop_at)
        self.heartbeats.add(running)
        metrics.started(started.family, started.waited, self.database)
        t0 = time.perf_counter()
        with tracing.delivery_span(started) as span:
            try:
                if reg.transactional:
                    result = self._run_in_transaction(started, family, reg.fn, running)
                else:
                    result = self._run(started, family, reg.fn, running, defer=defer)
            finally:
                self.heartbeats.remove(running)
                elapsed = time.perf_counter() - t0
                metrics.handled(started.family, started.command, elapsed, self.database)
                if self.run_times is not None:
                    self.run_times.record(started.family, elapsed)
            tracing.finish(span, result.outcome.value, result.detail)
        return result

    def _start(self, row_id: int, token: UUID, family_hint: str | None) -> Started | None:
        """The delivery start, carrying the settles of the rows delivered before it in this
        process (deferred_settles.py): one round trip, and they are settled before this row's
        handler runs."""
        pending = self.deferred.take_for_start()
        family = self.families.get(family_hint) if family_hint else None  # None: unknown
        try:
            started, settled = self.store.start(
                row_id,
                token,
                self._run_lease_for(family),
                carried(pending),
                flushed=self.store.starts_flushed(family),
            )
        except BaseException:
            self.deferred.give_back(pending)
            raise
        self.deferred.landed(pending, settled)
        return started

    def _run(
        self,
        started: Started,
        family: Family,
        fn: HandlerFn,
        running: Running,
        *,
        defer: bool,
    ) -> Result:
        """Run a handler outside any transaction of ours."""
        if log.isEnabledFor(logging.DEBUG):
            event(log, logging.DEBUG, "handler_started", "running handler", **_fields(started))
        t0 = time.perf_counter()
        try:
            returned = fn(running.ctx, started.payload)
        except Exception as exc:
            return self._finish(
                started, family, self._after_exception(started, family, exc, running)
            )
        elapsed = time.perf_counter() - t0
        if inspect.isawaitable(returned):
            return self._finish(
                started, family, Settle(SettleKind.PARK, error=_never_awaited(returned)), elapsed
            )
        settle = after_return(family, started.attempts, self.rand(), running.stop_reason())
        if not settle.delivers:
            return self._finish(started, family, settle, elapsed)
        if defer and not family.ordered and running.stop_reason() is None:
            # off the hot path: nothing waits on this settle (no ordered line moves on it); a
            # row cancelled while it ran settles now, so that its outcome says so
            self.deferred.add(settle.kind, started)
            if self.caps is not None and (slot := self._slot_of(started)) is not None:
                # a cap counts running handlers: this one returned, so its slot goes back now
                # (the answer, whether to wake the claimer, is read later: caps_pipelined)
                self._woken(self.caps.release_settled([slot], self.caps_database, wait=False))
            if log.isEnabledFor(logging.INFO):
                event(
                    log,
                    logging.INFO,
                    "delivered",
                    f"handler ok in {elapsed * 1000:.1f} ms (settle batched)",
                    **_fields(started),
                )
            return Result(Outcome.DELIVERED, started.id)
        return self._finish(started, family, settle, elapsed)

    def _flush_slot_writes(self) -> None:
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

    def _settle_refused(self, kind: SettleKind, started: Started) -> None:
        """A deferred settle the batch statement skipped: a cancel request arrived, or the
        claim was lost; the one-row path records which (the row's cap slot went back when
        its handler returned)."""
        family = self.families.get(started.family) or Family(started.family)
        self._finish(started, family, Settle(kind), release=False)

    def _run_in_transaction(
        self, started: Started, family: Family, fn: HandlerFn, running: Running
    ) -> Result:
        """The handler's writes and the row's settle commit together, fenced by the claim
        token, or not at all: exactly-once effects for work that stays in Postgres."""
        t0 = time.perf_counter()
        ctx = running.ctx
        try:
            with self.store.handler_transaction(started.id, started.token) as held:
                if held is None:  # the claim no longer holds
                    lost = Result(Outcome.LOST, started.id, "the claim no longer holds")
                    _report(started, lost, delivered(family), 0.0)
                    return lost
                conn, cancel = held
                if cancel:
                    raise _Cancelled()
                ctx.conn = conn
                returned = fn(ctx, started.payload)
                if inspect.isawaitable(returned):  # rolled back, and parked as below
                    raise PermanentFailure(_never_awaited(returned))
                reason = running.stop_reason()
                if reason is StopReason.CANCEL_REQUESTED:
                    raise _Cancelled()
                if reason is not None:
                    raise _Stopped(reason)  # roll the handler's writes back, then retry
                settled = self._settle(
                    delivered(family), started, family, conn=conn, release=False, or_cancel=False
                )
                if not settled:
                    raise _Cancelled()  # a cancel request arrived: undo the handler's writes
        except _Cancelled:
            return self._finish(started, family, Settle(SettleKind.CANCEL))
        except _Stopped as stop:  # rolled back: nothing was applied
            error = stop_error(family, None, stop.reason)
            return self._finish(
                started, family, after_failure(family, started.attempts, self.rand(), error)
            )
        except Exception as exc:
            return self._finish(
                started, family, self._after_exception(started, family, exc, running)
            )
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

    def _after_exception(
        self, started: Started, family: Family, exc: Exception, running: Running
    ) -> Settle:
        """A handler that raised: parked at once for PermanentFailure, else a failed attempt
        (the error says when it had been told to stop, or ran past its time limit)."""
        if isinstance(exc, PermanentFailure):
            return Settle(SettleKind.PARK, error=describe_error(exc))
        stop = running.stop_reason()
        if isinstance(exc, RetryLater) and stop is None:
            return retry_asked(family, started.attempts, exc.delay, str(exc))
        if type(exc).__name__ == "SoftTimeLimitExceeded":  # billiard's, raised by prefork
            stop = StopReason.TIME_LIMIT
        error = stop_error(family, describe_error(exc), stop)
        return after_failure(family, started.attempts, self.rand(), error)

    def _finish(
        self,
        started: Started,
        family: Family | None,
        settle: Settle,
        elapsed: float = 0.0,
        *,
        release: bool = True,
    ) -> Result:
        """Apply the settle decided for an attempt, and say what it came to; ``release``: give
        the row's cap slot back afterwards (not when it went back as its handler returned)."""
        applied = self._settle(settle, started, family, release=release)
        due_in = settle.delay if applied is SettleKind.RETRY else None
        result = Result(outcome(applied), started.id, settle.error or "", due_in)
        _report(started, result, settle, elapsed)
        return result

    # -- leases and slots -------------------------------------------------------------------

    def _run_lease_for(self, family: Family | None) -> float:
        # The begin statement sets the running lease before the row's family is known; the
        # queue the message came from names it, else the longest timeout is the safe choice.
        if family is not None:
            return family.heartbeat_timeout
        return max(f.heartbeat_timeout for f in self.families.values())

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

    def _check_slot(self, started: Started, family: Family) -> float | None:
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
                **_fields(started),
            )
            return LAPSED
        if state == 0:
            self.store.handback(started.id, started.token)
            event(
                log,
                logging.WARNING,
                "cap_slot_lapsed",
                "the row's cap slot expired before delivery began; row handed back",
                **_fields(started),
            )
            return LAPSED
        return None

    def _slot_renewer(
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
                        **_fields(started),
                    )
                    return SlotState.LAPSED
                event(log, logging.WARNING, "caps_unavailable", str(exc), **_fields(started))
                return SlotState.UNKNOWN
            if state == 0:
                return SlotState.LAPSED
            # 1 renewed; -1 the semaphores are being rebuilt from the live leases in Postgres,
            # ours among them, and no slot is granted until then
            until[0] = t0 + timeout
            return SlotState.HELD

        return renew

    # -- settling ---------------------------------------------------------------------------

    def _settle(
        self,
        settle: Settle,
        started: Started,
        family: Family | None,
        *,
        conn: Conn | None = None,
        release: bool = True,
        or_cancel: bool = True,
    ) -> SettleKind | None:
        """Settle fenced by the token (a pending cancel request wins); then free the cap slot
        so the claimer lets one waiting row of the actor in."""
        options: dict[str, Any] = {
            "delay": settle.delay,
            "error": settle.error,
            "conn": conn,
            "or_cancel": or_cancel,
            "maybe_applied": settle.maybe_applied,
        }
        if family is not None and family.ordered and started.actor is not None:
            applied = self.store.settle_in_line(
                settle.kind,
                started.id,
                started.token,
                family=family.name,
                actor=started.actor,
                parked_blocks=family.parked_blocks,
                **options,
            )
        else:
            applied = self.store.settle(settle.kind, started.id, started.token, **options)
        if release:
            self._release(started, family)
        return applied

    def _release(self, started: Started, family: Family | None) -> None:
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


def _never_awaited(returned: object) -> str:
    """Why a row whose handler returned an awaitable (a coroutine, a future) is parked: nothing
    here awaits it, so its work did not run. The coroutine is closed, unrun."""
    close = getattr(returned, "close", None)
    if callable(close):  # a coroutine never awaited would warn when collected
        close()
    return (
        f"the handler returned {type(returned).__name__}, which nothing awaits: handlers are "
        "plain functions run in Celery's pool processes, so its work did not run; make it "
        "synchronous (it may call asyncio.run(...)) and retry the parked row"
    )


def _deadlines(family: Family) -> tuple[float | None, float | None]:
    """When a handler is told to stop (the time limit), and when the heartbeat stops renewing
    its lease: at the hard limit, so a prefork worker kills a handler that swallowed the soft
    limit before its row can be claimed again."""
    hard = family.hard_time_limit()
    if family.time_limit is None or hard is None:
        return None, None
    now = time.monotonic()
    return now + family.time_limit, now + hard


def _report(started: Started, result: Result, settle: Settle, elapsed: float) -> None:
    """The log line of a settled attempt."""
    fields = _fields(started)
    match result.outcome:
        case Outcome.DELIVERED:
            message = f"handler ok in {elapsed * 1000:.1f} ms"
            event(log, logging.INFO, "delivered", message, **fields)
        case Outcome.RETRIED:
            message = f"handler failed, due again in {settle.delay:.1f} s: {settle.error}"
            event(log, logging.WARNING, "retried", message, **fields)
        case Outcome.PARKED:
            message = f"row parked: {settle.error} (inspect with `outbox-dispatch parked list`)"
            event(log, logging.ERROR, "parked", message, **fields)
        case Outcome.CANCELLED:
            event(log, logging.INFO, "cancelled", "row settled as cancelled", **fields)
        case _:
            message = (
                "the claim no longer holds (lease ran out and the row was claimed again); "
                "the result of this attempt is discarded"
            )
            event(log, logging.WARNING, "settle_refused", message, **fields)


def _fields(s: Started) -> dict[str, Any]:
    return {
        "row_id": s.id,
        "family": s.family,
        "command": s.command,
        "actor": s.actor,
        "attempt": s.attempts,
    }
