"""Moves due rows into Celery queues: claim per family in Postgres, commit, then publish.

The message carries only (row id, claim token). Publishing happens after the claim commits,
so a delivery never sees a token that is not yet visible; a claimer that dies between commit
and publish leaves leased rows that are claimed again after the lease, without an attempt
counted (their claim never started); one whose publish fails and lives on gives them back,
due at once (``_give_back``).

Capped families take a Redis slot per row while the candidates are locked; a row whose actor
is at its cap is not published but set waiting, out of the due range, until a slot of its
actor frees (the releasing worker makes it due) or one lease passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from outbox_dispatch.caps.rebuild import rebuild
from outbox_dispatch.caps.semaphore import Caps, CapsIncomplete, CapsUnavailable, Slot
from outbox_dispatch.claim.capped import CappedClaims, CapRuleOf
from outbox_dispatch.claim.runstats import RunStats
from outbox_dispatch.core.errors import DatabaseError, StatementCancelled
from outbox_dispatch.core.logs import event
from outbox_dispatch.core.policy import (
    Family,
    batch_after_cancel,
    batch_after_claim,
    broker_room,
    cap_rule,
    claim_can_wait,
    family_is_capped,
    rows_per_message,
)
from outbox_dispatch.core.rows import Claimed, ClaimResult, Holder
from outbox_dispatch.observe import metrics
from outbox_dispatch.store import Store

log = logging.getLogger(__name__)

Publisher = Callable[[Family, list[Claimed], int], None]  # rows, rows per message


@dataclass
class ClaimReport:
    claimed: dict[str, int] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    # families held back by their in-flight limit (or a full queue), not by a lack of due rows:
    # a listener claims them again shortly, instead of this pass spinning on a few rows each
    saturated: set[str] = field(default_factory=set)
    # capped families whose claim took slots freed since the claim before: a release within
    # the wake window after that announces nothing (caps_release.lua), so a listener claims
    # them again one window later (listener.py)
    freed: set[str] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(self.claimed.values())

    def merge(self, other: ClaimReport) -> None:
        """Add another database's pass to this one."""
        for mine, theirs in (
            (self.claimed, other.claimed),
            (self.parked, other.parked),
            (self.waiting, other.waiting),
        ):
            for key, n in theirs.items():
                _add(mine, key, n)
        self.rounds = max(self.rounds, other.rounds)
        self.saturated |= other.saturated
        self.freed |= other.freed


class Claimer:
    def __init__(
        self,
        store: Store,
        families: Mapping[str, Family],
        *,
        batch: int = 500,
        caps: Caps | None = None,
        cap_rule: CapRuleOf = lambda family, command, actor: cap_rule(family, command, None, actor),
        is_capped: Callable[[Family], bool] = lambda family: family_is_capped(family, False),
        queued: Callable[[Family], int] = lambda family: 0,
        consumers: Callable[[], int] = lambda: 1,
        run_stats: RunStats | None = None,
        database: str = "default",
        primary: bool = True,
        all_stores: Sequence[Store] = (),
    ) -> None:
        # max_in_flight holds per database; the family's broker queue is shared by them all
        self.queue_share = max(1, len(all_stores))
        self.store = store
        self.database = database  # its name, in metrics and logs
        self.caps_database = None if primary else database  # its freed-slot keys
        self.all_stores = list(all_stores)  # every database's store: a caps rebuild reads all
        self.families = families
        self.batch = batch
        self.caps = caps
        self.cap_rule = cap_rule
        self.is_capped = is_capped
        self.queued = queued
        self.consumers = consumers
        self.run_stats = run_stats
        self._passes = 0
        self._sizes: dict[str, int] = {}  # family -> rows per message of its last claim
        # family -> the most rows its claims take since the server cancelled one (a
        # statement_timeout shorter than the claim), until they are back to the batch
        self._cut: dict[str, int] = {}
        # its capped families' claims (capped.py); _claim_capped passes them self.caps
        self.capped = CappedClaims(store, cap_rule, self.caps_database)

    def message_size(self, family: Family, rows: int, queued: int | None = None) -> int:
        """Rows per delivery message for a claim of ``rows`` (see policy.rows_per_message);
        ``queued``: the family's queue length, when the caller has just read it."""
        if family.most_per_message <= 1 or rows <= 1:
            return 1
        stats = self.run_stats.of(family.name) if self.run_stats is not None else None
        return rows_per_message(
            rows,
            most=family.most_per_message,
            consumers=self.consumers_of(family),
            queued=self.queued(family) if queued is None else queued,
            run_time=stats[1] if stats else None,
            lease=family.lease,
        )

    def consumers_of(self, family: Family) -> int:
        """The processes that consume the family's queue at least: the setting (or this
        worker's concurrency), or more when more reported run times lately."""
        stats = self.run_stats.of(family.name) if self.run_stats is not None else None
        return max(self.consumers(), stats[0] if stats else 0)

    def claim_family(self, family: Family, *, batch: int | None = None) -> ClaimResult:
        t0 = time.perf_counter()
        if self.is_capped(family):
            result = self._claim_capped(family, batch or self.batch)
        else:
            result = self.store.claim(family, batch or self.batch)
        for row_id in result.parked:
            event(
                log,
                logging.ERROR,
                "parked",
                "row parked at claim: its last attempt ended without an outcome "
                "(handler crashed its worker or overran its lease)",
                row_id=row_id,
                family=family.name,
            )
        if family.ordered and result.parked_actors and not family.parked_blocks:
            self.store.promote_blocked(family.name, list(result.parked_actors), False)
        elapsed = time.perf_counter() - t0
        metrics.claimed(family.name, len(result.claimed), elapsed, self.database)
        if result.claimed or result.waiting:
            event(
                log,
                logging.DEBUG,
                "claimed",
                f"{len(result.claimed)} rows, {result.waiting} set waiting, "
                f"in {elapsed * 1000:.1f} ms",
                family=family.name,
            )
        return result

    # -- capped claims ----------------------------------------------------------------------

    def _claim_capped(self, family: Family, batch: int) -> ClaimResult:
        if self.caps is None:
            raise CapsUnavailable(
                f"family {family.name!r} has a per-actor cap but the dispatcher has no redis_url"
            )
        try:
            return self.capped.claim(family, batch, self.caps)
        except CapsIncomplete:
            try:
                restored = self.rebuild_caps()
            except DatabaseError as exc:
                # a database the rebuild must read is down: this family waits, the others (and
                # this database's uncapped families) are claimed
                raise CapsUnavailable(
                    f"the cap semaphores must be rebuilt from every database, and one did not "
                    f"answer ({exc}); capped rows wait until it does"
                ) from exc
            event(
                log,
                logging.WARNING,
                "caps_rebuilt",
                f"Redis had lost the cap semaphores; restored {restored} live holders from "
                "Postgres before claiming capped rows again",
                family=family.name,
            )
            return self.capped.claim(family, batch, self.caps)

    def rebuild_caps(self) -> int:
        """Restore every live lease's slot, from every database (caps are global), each for
        what is left of its own lease; see caps/rebuild.py."""
        caps = self.caps
        assert caps is not None
        capped = [f.name for f in self.families.values() if self.is_capped(f)]

        def slots(holders: list[Holder]) -> list[tuple[Slot, int]]:
            found = []
            for h in holders:
                r = self.cap_rule(self.families[h.family], h.command, h.actor)
                if r is not None:
                    found.append(
                        (Slot(h.family, h.actor, h.token, r.limit, r.scope), h.remaining_ms)
                    )
            return found

        restored = rebuild(
            self.all_stores or [self.store],
            capped,
            lambda holders: caps.restore(slots(holders)),
            lambda gone: caps.release_many([slot for slot, _ in slots(gone)]),
        )
        # the data loss took the waiting flags too: rows may wait, so releases note slots
        caps.note_waiting({name: self.families[name].lease for name in capped})
        return restored

    # -- the claim loop ---------------------------------------------------------------------

    def run(
        self,
        publish: Publisher,
        *,
        budget: float = 1.0,
        only: list[str] | None = None,
        refills: bool = False,
    ) -> ClaimReport:
        """Claim and publish every family (or those in ``only``) until none fills a batch or
        ``budget`` seconds pass. A family is claimed again within the pass only when the batch
        size held it back; one held back by its in-flight limit is reported ``saturated``.
        ``refills``: the caller claims the saturated families again within a refill interval
        (a commit listener), so a family whose queue holds work for every consumer is left
        for then, and reported saturated (policy.claim_can_wait)."""
        report = ClaimReport()
        deadline = time.monotonic() + budget
        pending = [f for f in self.families.values() if only is None or f.name in only]
        if len(pending) > 1:  # a pass over several families claims only those with work
            pending = self._with_work(pending)
        # each pass starts with the next family, so no family always claims (and publishes)
        # first while the pass's time budget lasts
        self._passes += 1
        if pending:
            shift = self._passes % len(pending)
            pending = pending[shift:] + pending[:shift]
        while pending:
            report.rounds += 1
            full: list[Family] = []
            for family in pending:
                queued = self.queued(family)
                if refills and claim_can_wait(
                    queued, self.consumers_of(family), family.most_per_message
                ):
                    report.saturated.add(family.name)
                    event(
                        log,
                        logging.DEBUG,
                        "claim_deferred",
                        f"the family's queue holds {queued} messages, work for every consumer: "
                        "its due rows are claimed together once it drains",
                        family=family.name,
                    )
                    continue
                room = broker_room(
                    family.max_in_flight * self.queue_share,
                    queued,
                    self._sizes.get(family.name, 1),
                )
                if room == 0:
                    report.saturated.add(family.name)
                    event(
                        log,
                        logging.DEBUG,
                        "queue_full",
                        "the family's broker queue holds max_in_flight rows: not claiming",
                        family=family.name,
                    )
                    continue
                limit = min(self.batch, room, self._cut.get(family.name, self.batch))
                try:
                    result = self.claim_family(family, batch=limit)
                except CapsUnavailable as exc:
                    event(log, logging.WARNING, "caps_unavailable", str(exc), family=family.name)
                    continue
                except StatementCancelled as exc:  # this family's; the others go on
                    cut = self._cut[family.name] = batch_after_cancel(limit)
                    event(
                        log,
                        logging.WARNING,
                        "claim_cancelled",
                        f"{exc}; the family is claimed again in the next pass, at most {cut} "
                        "rows a claim until claims go through again",
                        family=family.name,
                    )
                    continue
                except CapsIncomplete:  # lost again right after the rebuild: next pass
                    event(
                        log,
                        logging.WARNING,
                        "caps_incomplete",
                        "Redis lost the cap semaphores again during the rebuild; capped rows "
                        "are claimed in the next pass",
                        family=family.name,
                    )
                    continue
                if family.name in self._cut:  # it went through: grow back towards the batch
                    grown = batch_after_claim(self._cut.pop(family.name), self.batch)
                    if grown is not None:
                        self._cut[family.name] = grown
                if result.claimed:
                    size = self.message_size(family, len(result.claimed), queued)
                    self._sizes[family.name] = size
                    try:
                        publish(family, result.claimed, size)
                    except Exception as exc:  # not at an interrupt: its lease brings it back
                        self._give_back(family, result.claimed, exc)
                        raise
                _add(report.claimed, family.name, len(result.claimed))
                _add(report.parked, family.name, len(result.parked))
                _add(report.waiting, family.name, result.waiting)
                if result.freed:
                    report.freed.add(family.name)
                if 0 < result.limit <= len(result.claimed) + len(result.parked):
                    if result.limit == self.batch:
                        full.append(family)  # a whole batch: more rows may be due right now
                    else:  # its in-flight limit or broker room held it back
                        report.saturated.add(family.name)
                elif result.limit == 0:
                    # every in-flight slot is taken: the listener tries again shortly (one
                    # bounded count along the outbox_claimed index), so rows that settle free
                    # room within a refill interval, not at beat's next pass
                    report.saturated.add(family.name)
            pending = full
            if time.monotonic() >= deadline:
                report.saturated.update(f.name for f in pending)  # still work: top up later
                break
        return report

    def _give_back(self, family: Family, rows: list[Claimed], exc: Exception) -> None:
        """A claim committed and its publish failed: its rows not started are due again now,
        and their cap slots go back, so that the next pass (the listener's, within a second)
        claims them instead of each waiting out its lease while this process lives on."""
        try:
            back = self.store.give_back_claim([(r.id, r.token) for r in rows])
        except Exception as err:  # never hide the publish's own error behind this one
            event(
                log,
                logging.ERROR,
                "publish_failed",
                f"{len(rows)} claimed rows could not be published ({exc!r}) nor given back "
                f"({err}); they are claimed again after their lease ({family.lease:g} s)",
                family=family.name,
            )
            return
        if self.caps is not None and self.is_capped(family):
            self.caps.release_many(
                [
                    Slot(family.name, r.actor or "", r.token, rule.limit, rule.scope)
                    for r in rows
                    if r.id in back and (rule := self.cap_rule(family, r.command, r.actor))
                ]
            )
        started = len(rows) - len(back)
        event(
            log,
            logging.ERROR,
            "publish_failed",
            f"{len(rows)} claimed rows could not be published ({exc!r}); {len(back)} are due "
            "again now, for the next claim pass"
            + (f" ({started} had started and run)" if started else ""),
            family=family.name,
        )

    def _with_work(self, families: list[Family]) -> list[Family]:
        """The families a pass must claim: those with a due row (one statement for all), and
        capped ones whose actors freed slots since their last claim (one Redis round trip),
        since a freed slot makes a waiting row due in the claim itself. An idle pass over
        many families then costs two round trips, not a claim transaction each."""
        due = self.store.families_due([f.name for f in families])
        capped = [f.name for f in families if self.is_capped(f) and f.name not in due]
        if capped and self.caps is not None:
            try:
                due |= self.caps.freed_families(capped, self.caps_database)
            except CapsUnavailable:
                due |= set(capped)  # cannot tell: claim them, as the claim itself copes
        return [f for f in families if f.name in due]


def _add(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n
