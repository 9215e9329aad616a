"""Deliveries: an attempt's start, its lease renewals and its settle, fenced by the claim's
token, and transactional handlers' transactions."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from outbox_dispatch.core.rows import Started
from outbox_dispatch.core.settle import BATCH_QUERY, QUERY, SettleKind, leaves_line
from outbox_dispatch.store.connections import StoreBase, pipelined_transaction, translated
from outbox_dispatch.store.ordered import actor_lock
from outbox_dispatch.store.pool import Conn

# Seconds a delivery waits for a connection before its work goes to another worker
# (worker/delivery.py): its start (the message goes back to its queue), or a transactional
# handler's transaction (the row goes back uncounted). A worker whose pool, or whose share of
# Postgres's connections, is used up would otherwise hold the row for the pool's 30 s.
CONNECTION_WAIT = 2.0
# A start's wait while this process has not reached the database since its last failure (it
# holds no session: Postgres refuses it one, or is down): its message goes back at once, not
# after holding a consumer's slot, since other processes may have sessions.
OUTAGE_CONNECTION_WAIT = 0.25


class DeliveryQueries(StoreBase):
    """Starts, renewals and settles (sql/deliver.sql, sql/settle.sql)."""

    def begin(
        self, row_id: int, token: UUID, run_lease: float, *, flushed: bool = True
    ) -> Started | None:
        """Start an attempt; from now its lease is ``run_lease`` (the heartbeat timeout)."""
        return self.start(row_id, token, run_lease, flushed=flushed)[0]

    def start(
        self,
        row_id: int,
        token: UUID,
        run_lease: float,
        carry: Mapping[SettleKind, tuple[int, UUID]] | None = None,
        *,
        flushed: bool = True,
        first_delivery: bool = False,
    ) -> tuple[Started | None, set[int]]:
        """Start an attempt, and settle in the same statement the delivered rows in ``carry``
        (at most one per kind, ``delete`` or ``done``: deferred settles of rows delivered just
        before): one round trip for both, durable together. ``flushed``: whether it waits for
        its WAL flush (``starts_flushed`` of the row's family; without, a claim older than the
        server's start may not start, unless this is the ``first_delivery`` of its message).
        Returns the started row (None: the claim no longer
        holds) and the ids settled."""
        deleted = (carry or {}).get(SettleKind.DELETE, _NO_ROW)
        done = (carry or {}).get(SettleKind.DONE, _NO_ROW)
        params = {
            "id": row_id,
            "token": token,
            "run_lease": run_lease,
            "deleted": deleted[0],
            "deleted_token": deleted[1],
            "done": done[0],
            "done_token": done[1],
            "flushed": flushed,
            "first_delivery": first_delivery,
        }
        wait = OUTAGE_CONNECTION_WAIT if self.outage.on else CONNECTION_WAIT
        with translated("delivery start"), self._starting(wait) as conn:
            row = conn.execute(self.q["deliver_begin"], params).fetchone()
        assert row is not None  # a left join of one row: always one row
        settled = {int(i) for i in row[11:13] if i is not None}
        return _started(row_id, token, row if row[0] is not None else None), settled

    def settle_many(self, kind: SettleKind, pairs: Sequence[tuple[int, UUID]]) -> set[int]:
        """Settle delivered rows (``delete`` or ``done``) handed to the deferred settles;
        returns the ids settled."""
        if not pairs:
            return set()
        params = {"ids": [i for i, _ in pairs], "tokens": [t for _, t in pairs]}
        with translated(f"settle ({kind})"), self.connection() as conn:
            with pipelined_transaction(conn):  # one round trip: no flush, settle, commit
                conn.execute(self.q["settle_without_flush"])
                cur = conn.execute(self.q[BATCH_QUERY[kind]], params)
            rows = cur.fetchall()
        return {int(r[0]) for r in rows}

    def why_stale(self, row_id: int, token: UUID) -> str:
        with translated("stale check"), self._starting() as conn:
            row = conn.execute(
                self.q["deliver_explain_stale"], {"id": row_id, "token": token}
            ).fetchone()
        if row is None:
            return "row is gone (settled, purged or never existed)"
        same_token, started, lapsed, before_restart = row
        if not same_token:
            return "claim token is not the row's current one (row was re-claimed or settled)"
        if started:
            return "attempt already started (redelivered message); the lease decides"
        if lapsed:
            return "lease ran out before delivery began; the row will be claimed again"
        if before_restart:
            return (
                "claimed before Postgres last started, which may have lost the start of this "
                "redelivered message: the row runs again after its lease, flagged maybe_applied"
            )
        return "row is not deliverable"

    def renew(
        self, leases: Sequence[tuple[int, UUID, str | None]], run_lease: float
    ) -> dict[int, bool]:
        """Extend the given (id, token, progress as JSON text) leases by ``run_lease``; returns
        id -> cancel requested, for the leases still held (a missing id lost its claim)."""
        if not leases:
            return {}
        params = {
            "ids": [i for i, _, _ in leases],
            "tokens": [t for _, t, _ in leases],
            "progress": [p for _, _, p in leases],  # cast to jsonb[] by the statement
            "run_lease": run_lease,
        }
        with translated("lease renewal"), self.connection() as conn:
            rows = conn.execute(self.q["deliver_renew"], params).fetchall()
        return {int(r[0]): bool(r[1]) for r in rows}

    def settle(
        self,
        kind: SettleKind,
        row_id: int,
        token: UUID,
        *,
        delay: float = 0.0,
        error: str | None = None,
        conn: Conn | None = None,
        or_cancel: bool = True,
        maybe_applied: bool = False,
        traceback: str | None = None,
    ) -> SettleKind | None:
        """Settle fenced by the token; returns the settle applied (``kind``, or "cancel" when a
        cancel request was pending), or None when another claim owns the row now (or, with
        ``or_cancel=False``, a cancel request is pending). ``maybe_applied`` (retry): the next
        attempt is told this one's effects are unknown."""
        params = _settle_params(row_id, token, delay, error, maybe_applied, traceback)
        with translated(f"settle ({kind})"):
            if conn is not None:
                return self._settle_on(conn, kind, params, or_cancel)
            with self.connection() as own:
                return self._settle_on(own, kind, params, or_cancel)

    def _settle_on(
        self, conn: Conn, kind: SettleKind, params: dict[str, Any], or_cancel: bool
    ) -> SettleKind | None:
        """The settle, or, when someone asked to cancel the row meanwhile, the cancel."""
        if conn.execute(self.q[QUERY[kind]], params).fetchone() is not None:
            return kind
        if kind is SettleKind.CANCEL or not or_cancel:
            return None
        if conn.execute(self.q[QUERY[SettleKind.CANCEL]], params).fetchone() is not None:
            return SettleKind.CANCEL
        return None

    def settle_in_line(
        self,
        kind: SettleKind,
        row_id: int,
        token: UUID,
        *,
        family: str,
        actor: str,
        parked_blocks: bool,
        delay: float = 0.0,
        error: str | None = None,
        conn: Conn | None = None,
        or_cancel: bool = True,
        maybe_applied: bool = False,
        traceback: str | None = None,
    ) -> SettleKind | None:
        """Settle the head of an ordered actor and, when it leaves the line, promote the next
        row, under the actor's lock (a producer enqueueing now waits, then sees the change)."""
        params = _settle_params(row_id, token, delay, error, maybe_applied, traceback)
        with translated(f"settle ({kind})"):
            line = (family, actor, parked_blocks, or_cancel)
            if conn is not None:
                return self._settle_in_line_on(conn, kind, params, *line)
            with self.connection() as own, own.transaction():
                return self._settle_in_line_on(own, kind, params, *line)

    def _settle_in_line_on(
        self,
        conn: Conn,
        kind: SettleKind,
        params: dict[str, Any],
        family: str,
        actor: str,
        parked_blocks: bool,
        or_cancel: bool,
    ) -> SettleKind | None:
        lock = actor_lock(self.schema, family, actor)
        conn.execute(self.q["ordered_lock_actor"], {"lock_name": lock})
        applied = self._settle_on(conn, kind, params, or_cancel)
        if leaves_line(applied, parked_blocks):
            conn.execute(
                self.q["ordered_promote"],
                {"family": family, "actors": [actor], "parked_blocks": parked_blocks},
            )
        return applied

    @contextmanager
    def handler_transaction(self, row_id: int, token: UUID) -> Iterator[tuple[Conn, bool] | None]:
        """A transaction for a transactional handler: yields (connection, cancel requested),
        or None when the claim no longer holds. Commits when the block ends, rolls back when
        it raises. Its commit waits for the disk as the user's settings say, not as the
        pool's other writes do: the handler's effects and the row's settle are kept or lost
        together."""
        with (
            translated("transactional delivery"),
            self.connection(CONNECTION_WAIT) as conn,
            conn.transaction(),
        ):
            if self.pool.flush_forced:  # else the session commits as the user's settings say
                conn.execute(self.q["deliver_commit_as_configured"])
            row = conn.execute(
                self.q["deliver_check_claim"], {"id": row_id, "token": token}
            ).fetchone()
            yield (conn, bool(row[1])) if row is not None else None


def _settle_params(
    row_id: int,
    token: UUID,
    delay: float,
    error: str | None,
    maybe_applied: bool,
    traceback: str | None,
) -> dict[str, Any]:
    return {
        "id": row_id,
        "token": token,
        "delay": delay,
        "error": error,
        "maybe_applied": maybe_applied,
        "traceback": traceback,
    }


_NO_ROW = (0, UUID(int=0))  # ids start at 1: a carried settle of "no row" matches nothing


def _started(row_id: int, token: UUID, row: Sequence[Any] | None) -> Started | None:
    """The row a delivery start returned (deliver_begin's columns), None if it refused."""
    if row is None:
        return None
    family, command, actor, payload, attempts, maybe_applied, dedupe_key, cancel = row[:8]
    return Started(
        row_id,
        token,
        family,
        command,
        actor,
        payload,
        int(attempts),
        bool(maybe_applied),
        dedupe_key,
        bool(cancel),
        row[8],
        row[9],
        row[10],
    )
