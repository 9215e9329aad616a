"""Every query the dispatcher runs, over one psycopg connection pool (enqueue aside).

Driver errors are translated here, once, into the outbox error tree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from outbox_dispatch.core.cron import Schedule, due_ticks
from outbox_dispatch.core.errors import (
    DatabaseError,
    DatabaseUnavailable,
    IsolationNotSupported,
    SchemaNotReady,
    StatementCancelled,
)
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.policy import Candidate, Family, LostAttempt, starts_flushed
from outbox_dispatch.core.rows import (
    CappedDecision,
    Claimed,
    ClaimResult,
    FamilyStatus,
    Holder,
    LapsedHolder,
    Started,
)
from outbox_dispatch.core.settle import BATCH_QUERY, QUERY, SettleKind, leaves_line
from outbox_dispatch.core.validation import PreparedRow
from outbox_dispatch.store.health import PROBE_CONNECT_TIMEOUT, Breaker, liveness_options
from outbox_dispatch.store.pool import Conn, Pools
from outbox_dispatch.store.sqlfiles import queries_for


@contextmanager
def pipelined_transaction(conn: Conn) -> Iterator[None]:
    """A transaction in one pipeline, ``BEGIN`` and ``COMMIT`` sent as its statements: one
    round trip where nothing in the block fetches. psycopg's own transaction block syncs the
    pipeline at its end, a second round trip (a claim of one row took 1.36 ms that way
    against 1.03 ms, two trivial statements 0.52 against 0.30 ms). The connection is in
    autocommit (pool.py); ``BEGIN`` names its isolation level, as psycopg's would (a claim
    must read committed, whatever the server's default); a block that fails is rolled back, so
    the pool gets it back idle."""
    level = conn.isolation_level
    begin = "BEGIN" if level is None else f"BEGIN ISOLATION LEVEL {level.name.replace('_', ' ')}"
    try:
        with conn.pipeline() as pipeline:
            conn.execute(begin)
            yield
            conn.execute("COMMIT")
            pipeline.sync()
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        raise


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Turn driver errors into ours, keeping the cause for the traceback."""
    try:
        yield
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaNotReady(
            f"{action}: outbox table not found ({mask_dsn(str(exc.diag.message_primary))}): "
            "run `outbox-dispatch migrate`"
        ) from exc
    except psycopg.errors.UndefinedFunction as exc:  # a schema migrated by an older version
        raise SchemaNotReady(
            f"{action}: the outbox schema is behind this version "
            f"({mask_dsn(str(exc.diag.message_primary))}): run `outbox-dispatch migrate`"
        ) from exc
    except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
        raise StatementCancelled(
            f"{action}: cancelled by the server ({mask_dsn(str(exc.diag.message_primary))}): "
            "its statement_timeout or lock_timeout (or a pg_cancel_backend) ends the outbox's "
            "statements too; raise them for the outbox's role if this repeats"
        ) from exc
    except psycopg.errors.ReadOnlySqlTransaction as exc:  # a standby, or a read-only default
        raise DatabaseError(
            f"{action} failed: the database refuses writes "
            f"({mask_dsn(str(exc.diag.message_primary))}): point the outbox at the primary, "
            "with a role whose default_transaction_read_only is off"
        ) from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"{action} failed: {mask_dsn(str(exc))}") from exc


class Store:
    """Named queries for one schema, over fork-safe pools (pool.py)."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *,
        pool_size: int = 4,
        handler_pool_size: int = 32,
        name: str = "default",
        breaker: Breaker | None = None,
        flushed_starts: bool = False,
    ) -> None:
        self.database_url = database_url
        self.flushed_starts = flushed_starts  # every start waits for its flush (policy.py)
        self.name = name  # the dispatcher's name for this database
        self.breaker = breaker
        self.schema = schema
        self._clock_offset = 0.0
        self.q = queries_for(schema)
        self.channel = wake_channel(schema)
        self.pools = Pools(
            database_url,
            schema,
            pool_size=pool_size,
            handler_pool_size=handler_pool_size,
            main_options=liveness_options(database_url) if breaker is not None else None,
        )

    @property
    def clock_offset(self) -> float:
        """Seconds added to the database clock in every query (tests: leases run out without
        sleeping). Always 0 outside tests."""
        return self._clock_offset

    @clock_offset.setter
    def clock_offset(self, seconds: float) -> None:
        self._clock_offset = float(seconds)
        self.q = queries_for(self.schema, self._clock_offset)

    # -- connections -------------------------------------------------------------------------

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self.pools.main().connection() as conn:
            yield conn

    @contextmanager
    def _starting(self) -> Iterator[Conn]:
        """A connection for anything but finishing work already running (a claim, a delivery
        start, a claim request, status and maintenance reads). With a breaker (several
        databases, health.py), it fails at once while this database is down, and a failure to
        reach it opens the breaker; a pool that is merely busy is waited for, as always."""
        if self.breaker is None:
            with self.connection() as conn:
                yield conn
            return
        admission = self.breaker.admit()
        pool = self.pools.main()
        try:
            conn = pool.getconn(timeout=admission.timeout)
        except PoolTimeout as exc:
            why = "no connection from the pool in time"
            if admission.probe or not self._answers():
                self.breaker.failed(admission, why)
                raise DatabaseUnavailable(
                    f"database {self.breaker.name!r}: {why}; its rows wait until it is back, "
                    "the other databases go on"
                ) from exc
            try:
                conn = pool.getconn()  # it answers: the pool is busy, wait as always
            except BaseException:
                self.breaker.abandoned(admission)
                raise
        try:
            with conn:
                yield conn
        except psycopg.OperationalError as exc:
            if conn.broken or conn.closed:
                why = mask_dsn(str(exc).strip().splitlines()[0] if str(exc) else repr(exc))
                self.breaker.failed(admission, why)
                raise DatabaseUnavailable(
                    f"database {self.breaker.name!r} stopped answering ({why}); its rows wait "
                    "until it is back, the other databases go on"
                ) from exc
            self.breaker.succeeded(admission)  # it answered: the error is the work's own
            raise
        except BaseException:
            self.breaker.abandoned(admission)
            raise
        else:
            self.breaker.succeeded(admission)
        finally:
            pool.putconn(conn)

    def _answers(self) -> bool:
        """Whether a connection of its own reaches the database now (the pool had none to
        give in time: busy, or the database is down)."""
        try:
            psycopg.connect(self.database_url, connect_timeout=PROBE_CONNECT_TIMEOUT).close()
        except psycopg.Error:
            return False
        return True

    def close(self) -> None:
        self.pools.close()

    # -- enqueue (on the caller's connection) -----------------------------------------------

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
                conn, [_actor_lock(self.schema, row.family, row.actor or "")], "enqueue"
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
                {_actor_lock(self.schema, rows[i].family, rows[i].actor or "") for i in in_line}
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

    # -- claim ----------------------------------------------------------------------------

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
        """Whether this family's delivery starts wait for their WAL flush (policy.py)."""
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
        commit in the other (seven round trips before, each a wait for the GIL on a busy
        worker's listener)."""
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

    def promote_blocked(self, family: str, actors: list[str], parked_blocks: bool) -> list[int]:
        """Give actors whose head is gone their next row, under each actor's lock."""
        if not actors:
            return []
        with translated("promote ordered"), self._starting() as conn, conn.transaction():
            for actor in sorted(set(actors)):
                conn.execute(
                    self.q["ordered_lock_actor"],
                    {"lock_name": _actor_lock(self.schema, family, actor)},
                )
            rows = conn.execute(
                self.q["ordered_promote"],
                {"family": family, "actors": sorted(set(actors)), "parked_blocks": parked_blocks},
            ).fetchall()
        return [int(r[0]) for r in rows]

    # -- delivery -------------------------------------------------------------------------

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
    ) -> tuple[Started | None, set[int]]:
        """Start an attempt, and settle in the same statement the delivered rows in ``carry``
        (at most one per kind, ``delete`` or ``done``: deferred settles of rows delivered just
        before): one round trip for both, durable together. ``flushed``: whether it waits for
        its WAL flush (``starts_flushed`` of the row's family; without, a claim older than the
        server's start may not start). Returns the started row (None: the claim no longer
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
        }
        with translated("delivery start"), self._starting() as conn:
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
                "claimed before Postgres last started, which may have lost this attempt's "
                "start: the row runs again after its lease, flagged maybe_applied"
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
    ) -> SettleKind | None:
        """Settle fenced by the token; returns the settle applied (``kind``, or "cancel" when a
        cancel request was pending), or None when another claim owns the row now (or, with
        ``or_cancel=False``, a cancel request is pending). ``maybe_applied`` (retry): the next
        attempt is told this one's effects are unknown."""
        params = _settle_params(row_id, token, delay, error, maybe_applied)
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
    ) -> SettleKind | None:
        """Settle the head of an ordered actor and, when it leaves the line, promote the next
        row, under the actor's lock (a producer enqueueing now waits, then sees the change)."""
        params = _settle_params(row_id, token, delay, error, maybe_applied)
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
        lock = _actor_lock(self.schema, family, actor)
        conn.execute(self.q["ordered_lock_actor"], {"lock_name": lock})
        applied = self._settle_on(conn, kind, params, or_cancel)
        if leaves_line(applied, parked_blocks):
            conn.execute(
                self.q["ordered_promote"],
                {"family": family, "actors": [actor], "parked_blocks": parked_blocks},
            )
        return applied

    def cap_status(
        self, families: list[str]
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str, int]]]:
        """Waiting and blocked counts per family, and in-flight counts per (family, actor)."""
        with translated("status"), self._starting() as conn:
            counts = conn.execute(
                self.q["status_waiting_blocked"], {"families": families}
            ).fetchall()
            actors = conn.execute(
                self.q["status_actors_in_flight"], {"families": families}
            ).fetchall()
        return (
            {r[0]: (int(r[1]), int(r[2])) for r in counts},
            [(r[0], r[1], int(r[2])) for r in actors],
        )

    @contextmanager
    def handler_transaction(self, row_id: int, token: UUID) -> Iterator[tuple[Conn, bool] | None]:
        """A transaction for a transactional handler, on a connection of the handlers' own
        pool (a long handler must not starve heartbeats and settles of connections): yields
        (connection, cancel requested), or None when the claim no longer holds. Commits when
        the block ends, rolls back when it raises."""
        with (
            translated("transactional delivery"),
            self.pools.handlers().connection() as conn,
            conn.transaction(),
        ):
            row = conn.execute(
                self.q["deliver_check_claim"], {"id": row_id, "token": token}
            ).fetchone()
            yield (conn, bool(row[1])) if row is not None else None

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
                conn, [_actor_lock(self.schema, fam, act) for fam, act in in_line], "cancel"
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

    def cron_ticks(self, conn: Conn, schedule: Schedule, now: datetime | None) -> list[datetime]:
        """Under the schedule's row lock: the ticks to write, and the schedule advanced to now.
        ``now`` defaults to the database's clock."""
        with translated("cron"):
            if now is None:
                row = conn.execute(self.q["cron_now"]).fetchone()
                assert row is not None
                now = row[0]
            conn.execute(self.q["cron_lock"], {"name": schedule.name, "initial": now})
            found = conn.execute(self.q["cron_last"], {"name": schedule.name}).fetchone()
            assert found is not None
            ticks = due_ticks(
                schedule.expr, schedule.tz, found[0], now, schedule.catch_up, schedule.window
            )
            conn.execute(self.q["cron_advance"], {"name": schedule.name, "tick": now})
        return ticks

    def prune(self, family: str, retention: float, batch: int) -> int:
        with translated("prune"), self._starting() as conn:
            rows = conn.execute(
                self.q["maintenance_prune"],
                {"family": family, "retention": retention, "batch": batch},
            ).fetchall()
        return len(rows)

    # -- operations -----------------------------------------------------------------------

    def status(self) -> list[FamilyStatus]:
        with translated("status"), self._starting() as conn:
            rows = conn.execute(self.q["status_families"]).fetchall()
        return [
            FamilyStatus(
                family=r[0],
                due=int(r[1]),
                scheduled=int(r[2]),
                in_flight=int(r[3]),
                parked=int(r[4]),
                cancelled=int(r[5]),
                done=int(r[6]),
                oldest_due_age=float(r[7]),
                maybe_applied=int(r[8]),
            )
            for r in rows
        ]

    def parked_list(
        self, *, family: str | None = None, limit: int | None = 100
    ) -> list[dict[str, Any]]:
        with (
            translated("parked list"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            params = {"family": family, "limit": limit, "ids": None}
            return cur.execute(self.q["parked_list"], params).fetchall()

    def parked_retry(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        ordered: Mapping[str, bool] | None = None,
    ) -> list[int]:
        """Parked rows due again, attempts reset; in ordered families the retried rows get back
        in line and an actor without a head gets its lowest row, all in one transaction."""
        return self._parked_change(True, ids, family, ordered or {})

    def parked_purge(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        ordered: Mapping[str, bool] | None = None,
    ) -> list[int]:
        """Delete parked rows; an ordered actor whose parked head is gone gets its next row."""
        return self._parked_change(False, ids, family, ordered or {})

    def _parked_change(
        self, retry: bool, ids: list[int] | None, family: str | None, ordered: Mapping[str, bool]
    ) -> list[int]:
        sel = {"ids": ids, "family": family, "limit": 1_000_000}
        query = self.q["parked_retry"] if retry else self.q["parked_purge"]
        action = "parked retry" if retry else "parked purge"
        with translated(action), self._starting() as conn, conn.transaction():
            found = conn.execute(self.q["parked_list"], sel).fetchall()
            lines = sorted({(r[1], r[3]) for r in found if r[1] in ordered and r[3] is not None})
            for fam, actor in lines:
                lock = _actor_lock(self.schema, fam, actor)
                conn.execute(self.q["ordered_lock_actor"], {"lock_name": lock})
            chosen = [int(r[0]) for r in found]
            rows = conn.execute(query, {"ids": chosen, "family": None}).fetchall()
            done = sorted(int(r[0]) for r in rows)
            in_line = [int(r[0]) for r in rows if r[1] in ordered and r[2] is not None]
            if retry and in_line:
                conn.execute(self.q["ordered_block_rows"], {"ids": in_line})
            by_family: dict[str, list[str]] = {}
            for fam, actor in lines:
                by_family.setdefault(fam, []).append(actor)
            for fam, actors in by_family.items():
                conn.execute(
                    self.q["ordered_promote"],
                    {"family": fam, "actors": actors, "parked_blocks": ordered[fam]},
                )
        return done

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

    def command_of(self, conn: Conn, row_id: int) -> str | None:
        """The command of a row, on the caller's connection (its transaction sees the row)."""
        with translated("enqueue"):
            row = conn.execute(self.q["status_row_command"], {"id": row_id}).fetchone()
        return None if row is None else str(row[0])

    def find_rows(self, text: str, families: list[str], *, limit: int = 50) -> list[dict[str, Any]]:
        """Rows whose id, exact actor (in ``families``) or exact dedupe key is ``text``."""
        row_id = int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None
        params = {"id": row_id, "text": text, "families": families, "limit": limit}
        with (
            translated("find rows"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(self.q["status_find_rows"], params).fetchall())

    def row_state(self, row_id: int) -> str | None:
        """``parked``, ``cancelled``, ``done`` or ``live``; None when there is no such row."""
        with translated("row state"), self._starting() as conn:
            row = conn.execute(self.q["status_row_state"], {"id": row_id}).fetchone()
        if row is None:
            return None
        parked, cancelled, done = row
        return "parked" if parked else "cancelled" if cancelled else "done" if done else "live"

    def give_back_claim(self, rows: Sequence[tuple[int, UUID]]) -> set[int]:
        """Rows of a claim whose publish failed, as (id, token): due again now (those not
        started yet); returns the ids given back."""
        if not rows:
            return set()
        params = {"ids": [i for i, _ in rows], "tokens": [t for _, t in rows]}
        with translated("claim give-back"), self._starting() as conn:
            found = conn.execute(self.q["claim_give_back"], params).fetchall()
        return {int(r[0]) for r in found}

    def request_claim(self, family: str) -> None:
        """NOTIFY the commit listener, which claims the family at once."""
        with translated("claim request"), self._starting() as conn:
            conn.execute(self.q["claim_request"], {"channel": self.channel, "family": family})

    def sweep_heads(self, family: str, parked_blocks: bool) -> list[int]:
        """Give every headless actor of an ordered family its next row (crash repair)."""
        with translated("ordered sweep"), self._starting() as conn:
            rows = conn.execute(
                self.q["ordered_headless_actors"],
                {"family": family, "parked_blocks": parked_blocks},
            ).fetchall()
        actors = [r[0] for r in rows]
        return self.promote_blocked(family, actors, parked_blocks) if actors else []

    def unblock(self, family: str, batch: int) -> int:
        """Blocked rows of a family that is not ordered (any more) become due."""
        with translated("unblock"), self._starting() as conn:
            rows = conn.execute(
                self.q["ordered_unblock"], {"family": family, "batch": batch}
            ).fetchall()
        return len(rows)

    def prune_cancel_requests(self) -> int:
        with translated("prune"), self._starting() as conn:
            return len(conn.execute(self.q["maintenance_prune_cancel_requests"]).fetchall())

    # -- run stats ------------------------------------------------------------------------

    def report_run_time(self, family: str, process: str, run_seconds: float) -> None:
        params = {"family": family, "process": process, "run_seconds": run_seconds}
        with translated("run time report"), self._starting() as conn:
            conn.execute(self.q["runstats_report"], params)

    def run_stats(self, max_age: float) -> dict[str, tuple[int, float]]:
        """family -> (processes that reported within ``max_age`` s, their mean run time)."""
        with translated("run time read"), self._starting() as conn:
            rows = conn.execute(self.q["runstats_read"], {"max_age": max_age}).fetchall()
        return {str(r[0]): (int(r[1]), float(r[2])) for r in rows}

    def prune_run_stats(self, max_age: float) -> int:
        with translated("prune"), self._starting() as conn:
            return conn.execute(self.q["runstats_prune"], {"max_age": max_age}).rowcount


def wake_channel(schema: str) -> str:
    """The NOTIFY channel of a schema (LISTEN quotes it, so its case is kept)."""
    return f"outbox_{schema}"[:63]  # Postgres channel names are identifiers: 63 bytes


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


def _settle_params(
    row_id: int, token: UUID, delay: float, error: str | None, maybe_applied: bool
) -> dict[str, Any]:
    return {
        "id": row_id,
        "token": token,
        "delay": delay,
        "error": error,
        "maybe_applied": maybe_applied,
    }


def _actor_lock(schema: str, family: str, actor: str) -> str:
    return f"{schema}.actor.{family}.{actor}"


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
