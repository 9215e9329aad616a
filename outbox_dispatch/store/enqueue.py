"""Enqueue and cancel, on the caller's connection (ordered families' actors locked first), and
the NOTIFY that asks the commit listener for a claim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from outbox_dispatch.core.errors import DatabaseError, IsolationNotSupported
from outbox_dispatch.core.validation import PreparedRow
from outbox_dispatch.store.callers import All, Each, Exec, One, Steps
from outbox_dispatch.store.connections import StoreBase, translated
from outbox_dispatch.store.ordered import actor_lock


class EnqueueQueries(StoreBase):
    """Inserts, cancels and claim requests (sql/enqueue.sql, sql/cancel.sql). What runs on
    the caller's connection is a generator of steps (store/callers.py), so that one text
    serves every driver, sync or async."""

    def insert(self, row: PreparedRow, *, ordered: bool, parked_blocks: bool) -> Steps[int]:
        """One row; in an ordered family its actor's lock is taken first and held until the
        caller commits, so concurrent producers of one actor get ids in commit order."""
        params = {**_insert_params(row, self.channel), "parked_blocks": parked_blocks}
        sql = self.q["enqueue_insert"]
        if ordered and row.actor is not None:
            yield from self._lock_actors(
                [actor_lock(self.schema, row.family, row.actor)], "enqueue"
            )
            sql = self.q["enqueue_insert_ordered"]
        found = yield One(sql, params)
        if found is None:
            found = yield One(self.q["enqueue_find_dedupe"], params)
        if found is None:  # the holder of the key was deleted between the two statements
            raise DatabaseError("enqueue raced with the deletion of its dedupe key's row: retry")
        return int(found[0])

    def insert_many(
        self, rows: Sequence[PreparedRow], ordered: Mapping[str, bool]
    ) -> Steps[list[int]]:
        """Every row, ids in input order; dedupe hits are resolved after. ``ordered`` maps
        each ordered family to whether parked rows block; their actors are locked first, in
        sorted order, so two producers never deadlock on each other's actors."""
        if not rows:
            return []
        params = [
            {**_insert_params(r, self.channel), "parked_blocks": ordered.get(r.family, True)}
            for r in rows
        ]
        in_line = [i for i, r in enumerate(rows) if r.family in ordered and r.actor is not None]
        lined = set(in_line)
        plain = [i for i in range(len(rows)) if i not in lined]
        locks = sorted(
            {actor_lock(self.schema, rows[i].family, rows[i].actor or "") for i in in_line}
        )
        yield from self._lock_actors(locks, "enqueue_many")
        ids: list[int | None] = [None] * len(rows)
        for sql, group in (
            (self.q["enqueue_insert"], plain),
            (self.q["enqueue_insert_ordered"], in_line),
        ):
            if group:
                found = yield Each(sql, [params[i] for i in group])
                for i, got in zip(group, found, strict=True):
                    ids[i] = int(got[0]) if got is not None else None
        for i, value in enumerate(ids):
            if value is None:
                again = yield One(self.q["enqueue_find_dedupe"], params[i])
                if again is None:
                    raise DatabaseError("enqueue_many raced with a dedupe row's deletion: retry")
                ids[i] = int(again[0])
        return [int(i) for i in ids if i is not None]

    def _lock_actors(self, locks: Sequence[str], action: str) -> Steps[None]:
        """Take ordered actors' locks on the caller's transaction, which must be READ COMMITTED
        (its statements then see every commit made before the lock was granted). Any other
        level is refused before anything is written, and the transaction stays usable."""
        for name in locks:
            row = yield One(self.q["ordered_lock_actor_checked"], {"lock_name": name})
            isolation = str(row[0]) if row else "unknown"
            if isolation != "read committed":
                raise IsolationNotSupported(
                    f"{action} of an ordered family's row needs a READ COMMITTED transaction, "
                    f"and this one is {isolation.upper()}: its snapshot may predate another "
                    "producer's commit, so two rows of one actor could both run first. Use "
                    "READ COMMITTED for this transaction (nothing was written)"
                )

    def command_of(self, row_id: int) -> Steps[str | None]:
        """The command of a row, on the caller's connection (its transaction sees the row)."""
        row = yield One(self.q["status_row_command"], {"id": row_id})
        return None if row is None else str(row[0])

    def cancel(
        self,
        *,
        ids: list[int] | None,
        dedupe_key: str | None,
        actor: str | None,
        command: str | None,
        reason: str | None,
        by: str | None,
        ordered: Mapping[str, bool],
    ) -> Steps[tuple[list[int], list[int]]]:
        """Cancel on the caller's connection: (cancelled now, cancel requested of the holder)."""
        sel = {"ids": ids, "dedupe_key": dedupe_key, "actor": actor, "command": command}
        matched = yield All(self.q["cancel_match"], sel)
        if not matched:
            return [], []
        all_ids = [int(r[0]) for r in matched]
        in_line = sorted({(r[1], r[2]) for r in matched if r[1] in ordered and r[2]})
        yield from self._lock_actors([actor_lock(self.schema, f, a) for f, a in in_line], "cancel")
        yield Exec(self.q["cancel_request"], {"ids": all_ids, "reason": reason, "by": by})
        done = yield All(self.q["cancel_now"], {"ids": all_ids, "reason": reason, "by": by})
        for fam, act in in_line:
            yield All(
                self.q["ordered_promote"],
                {"family": fam, "actors": [act], "parked_blocks": ordered[fam]},
            )
        now = sorted(int(r[0]) for r in done)
        return now, sorted(set(all_ids) - set(now))

    def request_claim(self, family: str) -> None:
        """NOTIFY the commit listener, which claims the family at once."""
        with translated("claim request"), self._starting() as conn:
            conn.execute(self.q["claim_request"], {"channel": self.channel, "family": family})


def _insert_params(row: PreparedRow, channel: str) -> dict[str, Any]:
    return {
        "channel": channel,
        "wake": row.delay_seconds == 0 and row.at is None,
        "family": row.family,
        "command": row.command,
        "actor": row.actor,
        "payload": row.payload_json,
        "dedupe_key": row.dedupe_key,
        "delay": row.delay_seconds,
        "at": row.at,
        "trace": row.trace_json,
    }
