"""What the CLI, the outbox page and the Django admin do to rows (retry or purge parked rows,
cancel), with the reason for each named row that matched nothing, in one place: every surface
keeps ordered lines intact the same way and explains a miss in the same words. Each action is
recorded in the audit log (Operations.audit)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from outbox_dispatch.core.errors import DatabaseError, InvalidArgument
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.rows import RowFilter
from outbox_dispatch.operations import who

if TYPE_CHECKING:
    from outbox_dispatch.databases import Database
    from outbox_dispatch.dispatcher import Dispatcher


@dataclass(frozen=True)
class Done:
    """Rows an operation applied to (``ids``), running rows asked to stop (cancel only), and
    why each named row that matched nothing did not."""

    ids: list[int]
    reasons: list[str] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)

    @property
    def missed(self) -> bool:
        return bool(self.reasons)


def why_not(dispatcher: Dispatcher, row_id: int, action: str, database: str | None = None) -> str:
    """Why ``action`` (retry, purge, cancel) matched nothing for a row (of ``database``, the
    first by default), in the operator's terms."""
    state = dispatcher.database(database).store.row_state(row_id)
    if state is None:
        return f"row {row_id} does not exist (delivered rows are deleted unless kept by retention)"
    if state == "parked":
        if action == "cancel":
            return f"row {row_id} is parked: parked rows are purged, not cancelled"
        return f"row {row_id} is parked"
    if state == "cancelled":
        return f"row {row_id} is already cancelled"
    if state == "done":
        return f"row {row_id} was delivered (kept by its family's retention)"
    if action == "cancel":
        return f"row {row_id} was not cancelled: it may already have been asked to stop"
    return f"row {row_id} is not parked: only parked rows can be retried or purged"


def retry_parked(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    family: str | None = None,
    database: str | None = None,
    *,
    by: str | None = None,
    reason: str | None = None,
    record: bool = True,
) -> Done:
    """Parked rows (``ids``, or all of ``family``, or all) due again with attempts reset; row
    ids are of ``database`` (required for ids when there are several). Audited (``record``)."""
    done = dispatcher.ops.parked_retry(ids=ids, family=family, database=database)
    return _parked_done(dispatcher, "retry", done, ids, family, database, by, reason, record)


def purge_parked(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    family: str | None = None,
    database: str | None = None,
    *,
    by: str | None = None,
    reason: str | None = None,
    record: bool = True,
) -> Done:
    """Parked rows deleted; an ordered actor whose parked head is gone gets its next row.
    Audited (``record``)."""
    done = dispatcher.ops.parked_purge(ids=ids, family=family, database=database)
    return _parked_done(dispatcher, "purge", done, ids, family, database, by, reason, record)


def _parked_done(
    dispatcher: Dispatcher,
    action: str,
    done: list[int],
    ids: list[int] | None,
    family: str | None,
    database: str | None,
    by: str | None,
    reason: str | None,
    record: bool,
) -> Done:
    """A retry's or purge's audit row (unless ``record`` is off) and its explained result."""
    if record:
        selection = {"ids": ids, "family": family}
        dispatcher.ops.audit(action, selection, len(done), by=by, reason=reason, database=database)
    return Done(done, _misses(dispatcher, ids, done, action, database))


def cancel(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    *,
    dedupe_key: str | None = None,
    actor: str | None = None,
    command: str | None = None,
    reason: str | None = None,
    by: str,
    database: str | None = None,
    record: bool = True,
) -> Done:
    """Cancel rows by id, dedupe key or actor in one transaction per database: rows nobody
    delivers are cancelled at once, running ones asked to stop. Ids are of ``database``
    (required for ids when there are several); a key or an actor is looked for in every
    database unless one is named."""
    if ids is not None and not ids and dedupe_key is None and actor is None:
        return Done([], ["no row named"])  # an empty selection cancels nothing, never all
    cancelled: list[int] = []
    requested: list[int] = []
    if ids and database is None and len(dispatcher.databases) > 1:
        return Done([], ["row ids are per database: name the database of the ids"])
    for db in dispatcher.chosen_databases(database):
        with psycopg.connect(db.url) as conn, conn.transaction():
            targets: list[int | None] = list(ids) if ids else [None]
            for row_id in targets:
                result = dispatcher.cancel(
                    conn,
                    row_id,
                    dedupe_key=dedupe_key,
                    actor=actor,
                    command=command,
                    reason=reason,
                    by=by,
                    database=db.name,
                )
                cancelled += result.cancelled
                requested += result.requested
    matched = set(cancelled) | set(requested)
    selection = {"ids": ids, "dedupe_key": dedupe_key, "actor": actor, "command": command}
    if record:
        dispatcher.ops.audit(
            "cancel", selection, len(matched), by=by, reason=reason, database=database
        )
    reasons = [why_not(dispatcher, i, "cancel", database) for i in ids or [] if i not in matched]
    if not matched and not ids:
        reasons.append("no pending or running row matched")
    return Done(cancelled, reasons, requested)


def _misses(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    done: list[int],
    action: str,
    database: str | None = None,
) -> list[str]:
    missing = sorted(set(ids or []) - set(done))
    reasons = [why_not(dispatcher, i, action, database) for i in missing]
    if not done and not reasons:
        reasons.append("no parked row matched")
    return reasons


BULK_ACTIONS = ("retry", "purge", "cancel")
SAMPLE = 5  # rows a dry run shows
REACH_TIMEOUT = 5  # seconds an interrupted bulk action tries to record what it did


class BulkInterrupted(DatabaseError):
    """A bulk action stopped part way: the database failed one of its batches. Every batch is
    a transaction of its own, so each row was done whole or left as it was; ``done`` rows
    (cancel: cancelled or asked to stop) of ``count`` were done, and running the same action
    again does the rest."""

    def __init__(self, action: str, done: int, count: int, cause: str) -> None:
        self.action, self.done, self.count = action, done, count
        super().__init__(
            f"{action} stopped after {done} of {count} rows ({cause}); each batch is done "
            "whole or not at all, so no row is half done: run it again to finish"
        )


@dataclass(frozen=True)
class Bulk:
    """What a bulk action matched (``count``, a ``sample``) and, unless it was a dry run, the
    rows it applied to (``done``) and why others were skipped."""

    count: int
    sample: list[dict[str, Any]]
    done: int = 0
    requested: int = 0
    dry_run: bool = True


def bulk(
    dispatcher: Dispatcher,
    action: str,
    where: RowFilter,
    *,
    by: str | None = None,
    reason: str | None = None,
    dry_run: bool = False,
    batch: int = 500,
    progress: Callable[[int, int], None] | None = None,
    database: str | None = None,
) -> Bulk:
    """Retry or purge every parked row, or cancel every pending row, that ``where`` selects,
    in batches of ``batch`` rows, each in a short transaction of its own (so a million rows
    neither lock the table nor hold one long transaction); ``progress(done, count)`` after
    each. A dry run counts and shows a sample, and changes nothing. One audit row records
    the whole action, with the filter. A database that fails a batch part way (it went away)
    raises ``BulkInterrupted`` with how many rows were done: the batches before it are done
    whole, the rest untouched, and the audit row (marked ``interrupted``, written when the
    database still answers) counts them; the same call again does the rest."""
    if action not in BULK_ACTIONS:
        raise InvalidArgument(f"bulk action must be one of {BULK_ACTIONS}, got {action!r}")
    parked = action != "cancel"
    chosen = dispatcher.chosen_databases(database)
    count = sum(db.store.matching_count(where, parked=parked) for db in chosen)
    if dry_run:
        sample = [
            {"database": db.name, **row}
            for db in chosen
            for row in db.store.matching(where, parked=parked, limit=SAMPLE)
        ][:SAMPLE]
        return Bulk(count, sample)
    done = requested = 0
    selection: dict[str, Any] = {"filter": where.shown()}
    try:
        for db in chosen:
            after = 0
            while True:
                rows = db.store.matching(where, parked=parked, after=after, limit=batch)
                if not rows:
                    break
                ids = [int(r["id"]) for r in rows]
                after = ids[-1]
                kw: dict[str, Any] = {"by": by, "reason": reason, "record": False}
                if action == "retry":
                    done += len(retry_parked(dispatcher, ids, None, db.name, **kw).ids)
                elif action == "purge":
                    done += len(purge_parked(dispatcher, ids, None, db.name, **kw).ids)
                else:
                    result = cancel(dispatcher, ids, database=db.name, **{**kw, "by": who(by)})
                    done, requested = done + len(result.ids), requested + len(result.requested)
                if progress is not None:
                    progress(done + requested, count)
    except (DatabaseError, psycopg.Error) as exc:
        # the database went away (or failed a batch): what was done is recorded when it can
        # still be reached, and the caller is told how far it got
        why = mask_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        if done + requested and _reachable(chosen):
            with contextlib.suppress(DatabaseError, psycopg.Error):
                dispatcher.ops.audit(
                    action,
                    {**selection, "interrupted": True},
                    done + requested,
                    by=by,
                    reason=reason,
                    database=database,
                )
        raise BulkInterrupted(action, done + requested, count, why) from exc
    dispatcher.ops.audit(
        action, selection, done + requested, by=by, reason=reason, database=database
    )
    return Bulk(count, [], done, requested, dry_run=False)


def parked_matching(
    dispatcher: Dispatcher, where: RowFilter, *, limit: int = 200, database: str | None = None
) -> list[dict[str, Any]]:
    """The parked rows ``where`` selects, with the parked list's columns, oldest parked first:
    the first ``limit`` of each database (lowest ids), each naming its database. What the
    outbox page lists under a selection's count, so the list holds only the rows it counts."""
    found: list[dict[str, Any]] = []
    for db in dispatcher.chosen_databases(database):
        ids = [int(r["id"]) for r in db.store.matching(where, parked=True, limit=limit)]
        if not ids:
            continue
        rows = db.store.parked_list(ids=ids, limit=limit)
        found += [{"database": db.name, **row} for row in rows]
    return found


def _reachable(databases: list[Database]) -> bool:
    """Whether every database answers a connection of its own within seconds (a pool would
    wait its full timeout for a database that is down)."""
    try:
        for db in databases:
            psycopg.connect(db.url, connect_timeout=REACH_TIMEOUT).close()
    except psycopg.Error:
        return False
    return True
