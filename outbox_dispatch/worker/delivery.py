"""Runs one claimed row: check the claim, run the handler, settle fenced by the claim token,
then give back the row's cap slot and let the actor's next waiting row in. The steps, in order:
messages.py (what a message names), here (start, run; transactional.py runs a transactional
handler), settling.py (settle), slots.py (the cap slot that a capped row holds throughout)."""

from __future__ import annotations

import inspect
import logging
import random
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any
from uuid import UUID

from outbox_dispatch.caps.semaphore import Caps
from outbox_dispatch.claim.runstats import RunTimes
from outbox_dispatch.core.errors import (
    DatabaseError,
    NoConnection,
    StatementCancelled,
)
from outbox_dispatch.core.handlers import Context, HandlerFn, Registry
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import CapRule, Family, cap_rule
from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import (
    Outcome,
    Settle,
    SettleKind,
    after_return,
)
from outbox_dispatch.observe import metrics, tracing
from outbox_dispatch.store import Store
from outbox_dispatch.store.health import when_answering
from outbox_dispatch.worker.deferred_settles import DeferredSettles, carried
from outbox_dispatch.worker.heartbeat import Heartbeats, Running
from outbox_dispatch.worker.messages import (
    GoesBack,
    Result,
    parse_batch,
    parse_message,
    row_fields,
)
from outbox_dispatch.worker.settling import Settler, after_exception, never_awaited
from outbox_dispatch.worker.slots import LAPSED, CapSlots
from outbox_dispatch.worker.transactional import run_in_transaction

log = logging.getLogger(__name__)


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
        self.registry = registry
        self.families = families
        self.on_slot_freed = on_slot_freed
        self.rand = rand
        self.run_times = run_times
        self.heartbeats = Heartbeats(store)
        self.slots = CapSlots(
            store,
            families,
            caps,
            cap_rule,
            # looked up at each wake: one set on the Delivery afterwards is the one called
            lambda family, database: self.on_slot_freed(family, database),
            None if primary else database,  # its wake key
        )
        self.settler = Settler(store, families, self.slots)
        self.deferred = DeferredSettles(store, self.settler.refused)

    def deliver_message(
        self,
        args: tuple[Any, ...],
        *,
        family_hint: str | None = None,
        defer: bool = False,
        stop_at: float | None = None,
        first_delivery: bool = False,
    ) -> list[Result]:
        """Deliver what a broker message names: one (id, token) pair or a batch of them.
        ``defer``: a worker hands eligible successes to the deferred settles. ``stop_at``:
        when Celery's soft time limit for the message fires (monotonic, ``wiring.soft_limit_at``);
        a handler still running then did not return on its own, whatever it does with it.
        ``first_delivery``: no consumer had the message before (sql/deliver.sql). Raises
        GoesBack for the rows of a first delivery that could not start for want of a
        connection."""
        try:
            results = self._deliver_args(args, family_hint, defer, stop_at, first_delivery)
        except GoesBack as back:
            self._counted(back.done, family_hint)
            self.store.outage.failed("delivery start", str(back.cause))
            event(
                log,
                logging.INFO,
                "requeued",
                f"{back.cause}; {len(back.pairs)} rows not started go back to the queue",
                row_id=back.pairs[0][0],
                family=family_hint,
            )
            raise
        self._counted(results, family_hint)
        return results

    def _deliver_args(
        self,
        args: tuple[Any, ...],
        family_hint: str | None,
        defer: bool,
        stop_at: float | None,
        first_delivery: bool,
    ) -> list[Result]:
        pair = parse_message(args)
        if pair is not None:
            one = partial(
                self.deliver, *pair, family_hint=family_hint, defer=defer, stop_at=stop_at
            )
            try:
                return [one(first_delivery=first_delivery)]
            except StatementCancelled as exc:
                return [_cancelled(exc, pair[0], family_hint)]
        pairs = parse_batch(args)
        if pairs is not None:
            return self.deliver_batch(
                pairs,
                family_hint=family_hint,
                defer=defer,
                stop_at=stop_at,
                first_delivery=first_delivery,
            )
        shown = repr(args)[:200]
        event(log, logging.WARNING, "stale_dropped", f"garbage delivery message {shown}")
        return [Result(Outcome.STALE, None, "garbage message")]

    def _counted(self, results: list[Result], family_hint: str | None) -> None:
        """A message's end: the cap slots' releases sent, its rows' outcomes counted."""
        self.slots.flush()
        for r in results:
            metrics.outcome(family_hint, r.outcome.value, self.database)

    def deliver_batch(
        self,
        pairs: list[tuple[int, UUID]],
        *,
        family_hint: str | None = None,
        defer: bool = False,
        stop_at: float | None = None,
        first_delivery: bool = False,
    ) -> list[Result]:
        """A batched message: its rows one after another, each exactly as if it had come in a
        message of its own (its own start, attempt, time limit, cap slot, settle).

        Each row starts just before its handler runs, so a worker killed mid-batch leaves only
        the row it was running marked started (that one runs again with maybe_applied); the
        rows after it never began, and run when the broker redelivers the message, or are
        claimed again, uncounted, after their lease."""
        family = self.families.get(family_hint or "")
        hard = None if family is None else family.hard_time_limit()
        # Celery's hard limit for the message is the rows' limits added up (claim/publisher.py):
        # a row past its own keeps its lease until then, so no second copy starts while it runs
        until = None if hard is None else time.monotonic() + hard * len(pairs)
        results: list[Result] = []
        back: GoesBack | None = None
        one = partial(self.deliver, family_hint=family_hint, defer=defer, stop_at=stop_at)
        for row_id, token in pairs:
            try:
                results.append(one(row_id, token, renew_until=until, first_delivery=first_delivery))
            except StatementCancelled as exc:  # the database answers: the rows after it run
                results.append(_cancelled(exc, row_id, family_hint))
            except GoesBack as exc:  # no connection for its start: it and the rest go back
                back = GoesBack(pairs[len(results) :], exc.cause, results)
                break
            except DatabaseError as exc:
                # the database stayed down (a start waits for it) or refuses our statements: the
                # rows not started are claimed again after their lease; the finished are settled
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
        self.slots.flush()
        if back is not None:
            raise back
        return results

    def deliver(
        self,
        row_id: int,
        token: UUID,
        *,
        family_hint: str | None = None,
        defer: bool = False,
        renew_until: float | None = None,
        stop_at: float | None = None,
        first_delivery: bool = False,
    ) -> Result:
        if stop_at is not None and time.monotonic() >= stop_at:
            # the message's time limit has passed (a row before it ran long): this row
            # does not start, and is due again at once, uncounted
            self.store.give_back_claim([(row_id, token)])
            why = "not started: the message's time limit had passed"
            event(log, logging.INFO, "stale_dropped", why, row_id=row_id, family=family_hint)
            return Result(Outcome.STALE, row_id, why)
        try:
            started = self._start(row_id, token, family_hint, first_delivery)
        except NoConnection as exc:
            if not first_delivery:  # its rows may have started under another consumer
                raise
            raise GoesBack([(row_id, token)], exc) from exc  # its handler never ran here
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
            return self.settler.failed_checks(started, family)
        _ctx, running = self._context(started, family, renew_until, held, stop_at)
        self.heartbeats.add(running)
        metrics.started(started.family, started.waited, self.database)
        t0 = time.perf_counter()
        with tracing.delivery_span(started) as span:
            try:
                if reg.transactional:
                    result = run_in_transaction(
                        self.store, self.settler, started, family, reg.fn, running, self.rand
                    )
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

    def _start(
        self, row_id: int, token: UUID, family_hint: str | None, first_delivery: bool
    ) -> Started | None:
        """The delivery start, carrying the settles of the rows delivered before it in this
        process (deferred_settles.py): one round trip, and they are settled before this row's
        handler runs. While the database is not answering (a restart) it is tried again, so the
        row starts once it is back, not after its lease; with several databases (a breaker) a
        down one fails at once, and this pool process serves the others' rows meanwhile."""
        pending = self.deferred.take_for_start()
        family = self.families.get(family_hint) if family_hint else None  # None: unknown
        lease, flushed = self._run_lease_for(family), self.store.starts_flushed(family)
        start = partial(self.store.start, row_id, token, lease, carried(pending), flushed=flushed)
        start = partial(start, first_delivery=first_delivery)
        # a first delivery that gets no connection goes back to its queue (GoesBack) at once
        at_once = (NoConnection,) if first_delivery else ()
        try:
            if self.store.breaker is None:
                started, settled = when_answering(
                    start, self.store.outage, "delivery start", at_once=at_once
                )
            else:
                started, settled = start()
        except BaseException:
            self.deferred.give_back(pending)
            raise
        self.deferred.landed(pending, settled)
        return started

    def _run_lease_for(self, family: Family | None) -> float:
        # The begin statement sets the running lease before the row's family is known; the
        # queue the message came from names it, else the longest timeout is the safe choice.
        if family is not None:
            return family.heartbeat_timeout
        return max(f.heartbeat_timeout for f in self.families.values())

    def _check_slot(self, started: Started, family: Family) -> float | None:
        """The start's check of a capped row's cap slot (CapSlots.check): LAPSED when the row
        went back, else the seconds its slot is surely held (None: a whole heartbeat timeout,
        or no slot)."""
        return self.slots.check(started, family)

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
        renew = self.slots.renewer(started, family, held)
        running = Running(
            ctx=ctx,
            token=started.token,
            run_lease=family.heartbeat_timeout,
            renew_slot=renew,
            release_slot=None if renew is None else partial(self.slots.release, started, family),
            next_at=time.monotonic() + family.heartbeat_timeout / 3,
            soft_deadline=soft,
            deadline=hard,
        )
        return ctx, running

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
            event(log, logging.DEBUG, "handler_started", "running handler", **row_fields(started))
        t0 = time.perf_counter()
        try:
            returned = fn(running.ctx, started.payload)
        except Exception as exc:
            return self.settler.finish(
                started, family, after_exception(started, family, exc, running, self.rand)
            )
        elapsed = time.perf_counter() - t0
        if inspect.isawaitable(returned):
            return self.settler.finish(
                started, family, Settle(SettleKind.PARK, error=never_awaited(returned)), elapsed
            )
        settle = after_return(family, started.attempts, self.rand(), running.stop_reason())
        if not settle.delivers:
            return self.settler.finish(started, family, settle, elapsed)
        if defer and not family.ordered and running.stop_reason() is None:
            # off the hot path: nothing waits on this settle (no ordered line moves on it); a
            # row cancelled while it ran settles now, so that its outcome says so
            self.deferred.add(settle.kind, started)
            self.slots.release_returned(started)
            if log.isEnabledFor(logging.INFO):
                event(
                    log,
                    logging.INFO,
                    "delivered",
                    f"handler ok in {elapsed * 1000:.1f} ms (settle batched)",
                    **row_fields(started),
                )
            return Result(Outcome.DELIVERED, started.id)
        return self.settler.finish(started, family, settle, elapsed)


def _deadlines(family: Family) -> tuple[float | None, float | None]:
    """When a handler is told to stop (the time limit), and when the heartbeat stops renewing
    its lease: at the hard limit, so a prefork worker kills a handler that swallowed the soft
    limit before its row can be claimed again."""
    hard = family.hard_time_limit()
    if family.time_limit is None or hard is None:
        return None, None
    now = time.monotonic()
    return now + family.time_limit, now + hard
