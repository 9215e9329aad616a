"""Enqueue and cancel, on the caller's connection (ordered families' actors locked first), and
the NOTIFY that asks the commit listener for a claim."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from outbox_dispatch.core.errors import DatabaseError, IsolationNotSupported
from outbox_dispatch.core.validation import PreparedRow
from outbox_dispatch.store.connections import StoreBase, translated
from outbox_dispatch.store.ordered import actor_lock
from outbox_dispatch.store.pool import Conn


class EnqueueQueries(StoreBase):
    """Inserts, cancels and claim requests (sql/enqueue.sql, sql/cancel.sql)."""

    def insert(self, conn: Conn, row: PreparedRow) -> int:
        params = _insert_params(row, self.channel)
        with translated("enqueue"):
            found = conn.execute(self.q["enqueue_insert"], params).fetchone()
            if found is not None:
                return int(found[0])
            again = conn.execute(self.q["enqueue_find_dedupe"], params).fetchone()
        if again is None:  # the holder of the key was deleted between the two statements
            raise DatabaseError("enqueue raced with the deletion of its dedupe key's row: retry")
        return int(again[0])

    def insert_ordered(self, conn: Conn, row: PreparedRow, *, parked_blocks: bool) -> int:
        """Enqueue into an ordered family: the actor lock is held until the caller commits, so
        concurrent producers of one actor get ids in commit order."""
        params = {**_insert_params(row, self.channel), "parked_blocks": parked_blocks}
        with translated("enqueue"), _in_callers_transaction(conn):
            self._lock_actors_of_caller(
                conn, [actor_lock(self.schema, row.family, row.actor or "")], "enqueue"
            )
            found = conn.execute(self.q["enqueue_insert_ordered"], params).fetchone()
            if found is None:
                found = conn.execute(self.q["enqueue_find_dedupe"], params).fetchone()
        if found is None:
            raise DatabaseError("enqueue raced with the deletion of its dedupe key's row: retry")
        return int(found[0])

    def insert_many(
        self, conn: Conn, rows: Sequence[PreparedRow], ordered: Mapping[str, bool]
    ) -> list[int]:
        """Pipelined inserts; dedupe hits are resolved after. ``ordered`` maps each ordered
        family to whether parked rows block; their actors are locked first, in sorted order, so
        two producers never deadlock on each other's actors."""
        if not rows:
            return []
        params = [
            {**_insert_params(r, self.channel), "parked_blocks": ordered.get(r.family, True)}
            for r in rows
        ]
        in_line = [i for i, r in enumerate(rows) if r.family in ordered and r.actor is not None]
        lined = set(in_line)
        plain = [i for i in range(len(rows)) if i not in lined]
        ids: list[int | None] = [None] * len(rows)
        scope = _in_callers_transaction(conn) if in_line else contextlib.nullcontext()
        with translated("enqueue_many"), scope, conn.cursor() as cur:
            locks = sorted(
                {actor_lock(self.schema, rows[i].family, rows[i].actor or "") for i in in_line}
            )
            self._lock_actors_of_caller(conn, locks, "enqueue_many")
            for query, group in (
                (self.q["enqueue_insert"], plain),
                (self.q["enqueue_insert_ordered"], in_line),
            ):
                if not group:
                    continue
                cur.executemany(query, [params[i] for i in group], returning=True)
                for i in group:
                    got = cur.fetchone()
                    ids[i] = int(got[0]) if got is not None else None
                    cur.nextset()
            for i, value in enumerate(ids):
                if value is None:
                    found = conn.execute(self.q["enqueue_find_dedupe"], params[i]).fetchone()
                    if found is None:
                        raise DatabaseError(
                            "enqueue_many raced with a dedupe row's deletion: retry"
                        )
                    ids[i] = int(found[0])
        return [int(i) for i in ids if i is not None]

    def _lock_actors_of_caller(self, conn: Conn, locks: Sequence[str], action: str) -> None:
        """Take ordered actors' locks on the caller's transaction, which must be READ COMMITTED
        (its statements then see every commit made before the lock was granted). Any other
        level is refused before anything is written, and the transaction stays usable."""
        for name in locks:
            row = conn.execute(self.q["ordered_lock_actor_checked"], {"lock_name": name}).fetchone()
            isolation = str(row[0]) if row else "unknown"
            if isolation != "read committed":
                raise IsolationNotSupported(
                    f"{action} of an ordered family's row needs a READ COMMITTED transaction, "
                    f"and this one is {isolation.upper()}: its snapshot may predate another "
                    "producer's commit, so two rows of one actor could both run first. Use "
                    "READ COMMITTED for this transaction (nothing was written)"
                )

    def command_of(self, conn: Conn, row_id: int) -> str | None:
        """The command of a row, on the caller's connection (its transaction sees the row)."""
        with translated("enqueue"):
            row = conn.execute(self.q["status_row_command"], {"id": row_id}).fetchone()
        return None if row is None else str(row[0])

    def cancel(
        self,
        conn: Conn,
        *,
        ids: list[int] | None,
        dedupe_key: str | None,
        actor: str | None,
        command: str | None,
        reason: str | None,
        by: str | None,
        ordered: Mapping[str, bool],
    ) -> tuple[list[int], list[int]]:
        """Cancel on the caller's connection: (cancelled now, cancel requested of the holder)."""
        sel = {"ids": ids, "dedupe_key": dedupe_key, "actor": actor, "command": command}
        with translated("cancel"):
            matched = conn.execute(self.q["cancel_match"], sel).fetchall()
            if not matched:
                return [], []
            all_ids = [int(r[0]) for r in matched]
            in_line = sorted({(r[1], r[2]) for r in matched if r[1] in ordered and r[2]})
            self._lock_actors_of_caller(
                conn, [actor_lock(self.schema, fam, act) for fam, act in in_line], "cancel"
            )
            conn.execute(self.q["cancel_request"], {"ids": all_ids, "reason": reason, "by": by})
            done = conn.execute(
                self.q["cancel_now"], {"ids": all_ids, "reason": reason, "by": by}
            ).fetchall()
            for fam, act in in_line:
                conn.execute(
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


def _in_callers_transaction(conn: Conn) -> contextlib.AbstractContextManager[Any]:
    """Statements that belong together, in the caller's transaction. psycopg's transaction() on
    an idle connection that is not in autocommit opens and commits a transaction of its own, so
    the row would commit without the caller's change (and survive its rollback): there the
    implicit transaction the statements open is the caller's, and is scope enough."""
    return conn.transaction() if conn.autocommit else contextlib.nullcontext()
