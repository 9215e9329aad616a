"""What an operator does to rows (retry or purge parked rows, cancel), with the reason for
each row that matched nothing, in one place: the CLI, the Django admin and the web page call
these, so every one of them keeps ordered lines intact the same way (the Dispatcher's
methods) and explains a miss in the same words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg

if TYPE_CHECKING:
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
) -> Done:
    """Parked rows (``ids``, or all of ``family``, or all) due again with attempts reset; row
    ids are of ``database`` (required for ids when there are several)."""
    done = dispatcher.parked_retry(ids=ids, family=family, database=database)
    return Done(done, _misses(dispatcher, ids, done, "retry", database))


def purge_parked(
    dispatcher: Dispatcher,
    ids: list[int] | None,
    family: str | None = None,
    database: str | None = None,
) -> Done:
    """Parked rows deleted; an ordered actor whose parked head is gone gets its next row."""
    done = dispatcher.parked_purge(ids=ids, family=family, database=database)
    return Done(done, _misses(dispatcher, ids, done, "purge", database))


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
