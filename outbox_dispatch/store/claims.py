"""Claims: leasing a family's due rows (a capped family's through its caps), the caps
rebuild's reads, and claimed rows given back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any
from uuid import UUID

from outbox_dispatch.core.policy import Candidate, Family, LostAttempt, starts_flushed
from outbox_dispatch.core.rows import CappedDecision, Claimed, ClaimResult, Holder, LapsedHolder
from outbox_dispatch.store.connections import StoreBase, pipelined_transaction, translated
from outbox_dispatch.store.pool import Conn


class ClaimQueries(StoreBase):
    """Claims and leases (sql/claim.sql, sql/caps.sql)."""

    def claim(self, family: Family, batch: int) -> ClaimResult:
        """Lease up to ``batch`` due rows of a family, within its free in-flight capacity.

        One round trip: begin, the family lock, count-pick-lease and commit, pipelined."""
        with (
            translated(f"claim of family {family.name}"),
            self._starting() as conn,
        ):
            with pipelined_transaction(conn):
                self._lock_family(conn, family)
                leased = self._lease(conn, family, None, [], batch)
            rows = leased.fetchall()
        limit = int(rows[0][0]) if rows and rows[0][0] is not None else 0
        return _claim_result(family.name, [r[1:] for r in rows if r[1] is not None], limit)

    def _lease(
        self,
        conn: Conn,
        family: Family,
        ids: list[int] | None,
        tokens: list[UUID],
        batch: int = 0,
    ) -> Any:
        """The lease statement: for rows the claim holds locked (``ids``), or for the due rows
        it picks itself (``ids`` None, up to ``batch`` within the in-flight limit); its cursor
        (in pipeline mode the rows can be fetched after the commit was queued). ``ids`` and
        their ``tokens`` go sorted by id: the statement finds each row's token by binary
        search."""
        if ids and tokens:
            pairs = sorted(zip(ids, tokens, strict=True))
            ids, tokens = [i for i, _ in pairs], [t for _, t in pairs]
        params = {
            **_lease_params(family),
            "flushed_starts": self.starts_flushed(family),
            "family": family.name,
            "ids": ids,
            "tokens": tokens,
            "batch": batch,
            "max_in_flight": family.max_in_flight,
        }
        return conn.execute(self.q["claim_lease"], params)

    def _lock_family(self, conn: Conn, family: Family) -> None:
        """The family's claim lock, held to commit: in-flight counts cannot race. It also
        says whether the claim commits flushed: it does when the family's starts do not."""
        conn.execute(
            self.q["claim_lock_family"],
            {
                "lock_name": self._claim_lock(family),
                "flushed_starts": self.starts_flushed(family),
            },
        )

    def _claim_lock(self, family: Family) -> str:
        """The family's claim lock: claims serialize on it."""
        return f"{self.schema}.claim.{family.name}"

    def starts_flushed(self, family: Family | None) -> bool:
        """Whether this family's delivery starts wait for their WAL flush (core/policy.py)."""
        return starts_flushed(family, self.flushed_starts)

    def claim_capped(
        self,
        family: Family,
        batch: int,
        decide: Callable[[list[Candidate], int, list[LapsedHolder]], CappedDecision],
        freed: Mapping[str, int] | None = None,
    ) -> ClaimResult:
        """A claim for a family with per-actor caps. ``decide`` gives back the slots of the
        family's started attempts whose lease ran out, then picks rows and takes their cap
        slots while the candidates are locked; the shared caps lock is held to commit so a
        rebuild of the semaphores sees every claim that took slots. ``freed``: that many
        waiting rows of each actor are offered first, and leased straight from waiting when
        they get a slot; those the claim has no room for come due now.

        Two pipelined round trips around ``decide``: the locks, the freed rows, the lapsed
        holders and the candidates in one; the lease, the rows set waiting or due and the
        commit in the other."""
        with (
            translated(f"claim of family {family.name}"),
            self._starting() as conn,
        ):
            with pipelined_transaction(conn):
                conn.execute(self.q["caps_lock_shared"], {"lock_name": f"{self.schema}.caps"})
                picked = (
                    conn.execute(
                        self.q["claim_freed_waiting"],
                        {
                            "family": family.name,
                            "actors": list(freed),
                            "counts": list(freed.values()),
                        },
                    )
                    if freed
                    else None
                )
                self._lock_family(conn, family)
                lapsed = conn.execute(self.q["claim_lapsed_holders"], {"family": family.name})
                found = conn.execute(
                    self.q["claim_capped_candidates"],
                    {"family": family.name, "batch": batch, "max_in_flight": family.max_in_flight},
                ).fetchall()  # sends the statements above, and waits for them all
                waiting = (
                    [Candidate(int(r[0]), r[1], r[2], 1) for r in picked.fetchall()]
                    if picked is not None
                    else []
                )
                limit = int(found[0][0]) if found else 0
                candidates = [
                    Candidate(int(r[1]), r[2], r[3], int(r[4])) for r in found if r[1] is not None
                ]
                dead = [LapsedHolder(r[0], r[1], r[2]) for r in lapsed.fetchall()]
                take, wait = decide(waiting + candidates, limit, dead)
                ids, tokens = [i for i, _ in take], [t for _, t in take]
                leased = self._lease(conn, family, ids, tokens) if ids else None
                # a freed row refused a slot (another row took it) stays waiting as it is
                held = {c.id for c in waiting}.intersection(wait)
                wait = [i for i in wait if i not in held]
                if wait:
                    conn.execute(
                        self.q["claim_mark_waiting"],
                        {
                            "ids": wait,
                            "lease": family.lease,
                            "flushed_starts": self.starts_flushed(family),
                        },
                    )
                answered = set(ids) | held  # leased, or refused a slot
                if no_room := [c.id for c in waiting if c.id not in answered]:
                    conn.execute(self.q["claim_promote"], {"ids": no_room})
            rows = [r[1:] for r in leased.fetchall() if r[1] is not None] if leased else []
        result = _claim_result(family.name, rows, limit)
        return replace(result, waiting=len(wait))

    @contextmanager
    def caps_frozen(self, families: list[str]) -> Iterator[list[Holder]]:
        """Every live lease of the capped families, read under the exclusive caps lock, which
        is held while the block runs (no capped claim of this database is between taking slots
        and committing meanwhile)."""
        with translated("caps rebuild"), self._starting() as conn, conn.transaction():
            conn.execute(self.q["caps_lock_exclusive"], {"lock_name": f"{self.schema}.caps"})
            rows = conn.execute(self.q["caps_live_leases"], {"families": families}).fetchall()
            yield [Holder(r[0], r[1], r[2], r[3], int(r[4])) for r in rows]

    def leases_held(self, tokens: list[UUID]) -> set[UUID]:
        """The tokens among ``tokens`` whose lease still holds (a settle does not wait for the
        caps lock, so a holder restored by a rebuild may have settled meanwhile)."""
        if not tokens:
            return set()
        with translated("caps rebuild"), self._starting() as conn:
            held = conn.execute(self.q["caps_leases_held"], {"tokens": tokens}).fetchall()
        return {r[0] for r in held}

    def handback(self, row_id: int, token: UUID) -> bool:
        with translated("hand back"), self.connection() as conn:
            return (
                conn.execute(self.q["deliver_handback"], {"id": row_id, "token": token}).fetchone()
                is not None
            )

    def families_due(self, families: Sequence[str]) -> set[str]:
        """The families among ``families`` that have a due row now."""
        if not families:
            return set()
        with (
            translated("claim pass (which families have due rows)"),
            self._starting() as conn,
        ):
            rows = conn.execute(self.q["claim_families_due"], {"families": list(families)})
            return {str(r[0]) for r in rows.fetchall()}

    def give_back_claim(self, rows: Sequence[tuple[int, UUID]]) -> set[int]:
        """Rows of a claim whose publish failed, as (id, token): due again now (those not
        started yet); returns the ids given back."""
        if not rows:
            return set()
        params = {"ids": [i for i, _ in rows], "tokens": [t for _, t in rows]}
        with translated("claim give-back"), self._starting() as conn:
            found = conn.execute(self.q["claim_give_back"], params).fetchall()
        return {int(r[0]) for r in found}


def _lease_params(family: Family) -> dict[str, Any]:
    """The claim statements' policy parameters: lease and when a lost attempt parks."""
    return {
        "lease": family.lease,
        "max_attempts": family.max_attempts,
        "park_lost": family.on_lost is LostAttempt.PARK,
        "max_lost": family.max_lost,
    }


def _claim_result(family: str, rows: Sequence[Sequence[Any]], limit: int) -> ClaimResult:
    claimed: list[Claimed] = []
    parked: list[int] = []
    parked_actors: list[str] = []
    for rid, token, command, actor, attempts, exhausted, _error in rows:
        if exhausted:
            parked.append(int(rid))
            if actor is not None:
                parked_actors.append(actor)
        else:
            claimed.append(Claimed(int(rid), token, command, actor, int(attempts)))
    claimed.sort(key=lambda c: c.id)
    return ClaimResult(family, claimed, parked, limit, 0, tuple(parked_actors))
