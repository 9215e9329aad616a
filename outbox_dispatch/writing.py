"""Writing rows on the caller's connection, for ``enqueue``, ``enqueue_many``, ``cancel``, their
async forms and task calls: the rows are validated here, the database is chosen from the
connection, and the statements (store/enqueue.py) run on the caller's driver, sync or async
(store/callers.py), in the caller's transaction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from outbox_dispatch.core.errors import InvalidArgument, UnknownFamily
from outbox_dispatch.core.validation import Message, PreparedRow, prepare
from outbox_dispatch.databases import Database, pick
from outbox_dispatch.observe import tracing
from outbox_dispatch.store.async_callers import AsyncCaller, async_caller
from outbox_dispatch.store.callers import Caller, Steps, sync_caller

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher


class Writer:
    """The write side of one Dispatcher (``dispatcher.writer``)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def row(
        self,
        command: str,
        payload: Any,
        actor: object,
        dedupe_key: object,
        delay: object,
        at: object,
        family: str | None = None,
        *,
        trace_json: str | None,
    ) -> PreparedRow:
        """A validated row; ``trace_json`` is the caller's trace context, read once per call
        (reading it per row is costly in a big batch)."""
        d = self.dispatcher
        fam = d.registry.family_of(command) if family is None else family
        if fam not in d.families:
            raise UnknownFamily(f"command {command!r} belongs to undeclared family {fam!r}")
        row = prepare(
            family=fam,
            command=command,
            payload=payload,
            actor=actor,
            dedupe_key=dedupe_key,
            delay=delay,
            at=at,
            payload_limit=d.settings.payload_limit,
        )
        return replace(row, trace_json=trace_json) if trace_json else row

    def rows(self, messages: Iterable[Message]) -> list[PreparedRow]:
        """Every message validated before anything is written."""
        trace_json = tracing.current_context_json()  # one context for the whole batch
        out = []
        for m in messages:
            if not isinstance(m, Message):
                raise InvalidArgument(f"enqueue_many takes Message objects, got {type(m).__name__}")
            out.append(
                self.row(
                    m.command,
                    m.payload,
                    m.actor,
                    m.dedupe_key,
                    m.delay,
                    m.at,
                    trace_json=trace_json,
                )
            )
        return out

    def insert(self, db: Database, row: PreparedRow) -> Steps[int]:
        fam = self.dispatcher.families[row.family]
        return db.store.insert(row, ordered=fam.ordered, parked_blocks=fam.parked_blocks)

    # -- which database ------------------------------------------------------------------

    def _named(self, caller: Caller | AsyncCaller, name: str | None) -> str | None:
        """A Django connection whose alias is one of our database names is that database."""
        d = self.dispatcher
        alias = getattr(caller.holder, "alias", None) if name is None else None
        if isinstance(alias, str) and alias in d.databases and d.several:
            return alias
        return name

    def database(self, caller: Caller, name: str | None = None) -> Database:
        """The database the caller's connection writes to; refused with UnknownDatabase when
        it is none of ours."""
        d = self.dispatcher
        name = self._named(caller, name)
        target = caller.target() if d.several else None
        return pick(d.databases, name, target)

    async def adatabase(self, caller: AsyncCaller, name: str | None = None) -> Database:
        d = self.dispatcher
        name = self._named(caller, name)
        target = await caller.target() if d.several else None
        return pick(d.databases, name, target)

    # -- sync and async writes -------------------------------------------------------------

    def write(self, conn: object, row: PreparedRow, database: str | None) -> int:
        caller = sync_caller(conn)
        return caller.drive(self.insert(self.database(caller, database), row), "enqueue")

    async def awrite(self, conn: object, row: PreparedRow, database: str | None) -> int:
        caller = await async_caller(conn)
        db = await self.adatabase(caller, database)
        return await caller.drive(self.insert(db, row), "enqueue")

    def write_many(self, conn: object, rows: list[PreparedRow], database: str | None) -> list[int]:
        caller = sync_caller(conn)
        db = self.database(caller, database)
        return caller.drive(
            db.store.insert_many(rows, self.dispatcher.ordered_families()), "enqueue_many"
        )

    async def awrite_many(
        self, conn: object, rows: list[PreparedRow], database: str | None
    ) -> list[int]:
        caller = await async_caller(conn)
        db = await self.adatabase(caller, database)
        steps = db.store.insert_many(rows, self.dispatcher.ordered_families())
        return await caller.drive(steps, "enqueue_many")

    def cancel(
        self, conn: object, database: str | None, **selection: Any
    ) -> tuple[list[int], list[int]]:
        caller = sync_caller(conn)
        db = self.database(caller, database)
        steps = db.store.cancel(ordered=self.dispatcher.ordered_families(), **selection)
        return caller.drive(steps, "cancel")

    async def acancel(
        self, conn: object, database: str | None, **selection: Any
    ) -> tuple[list[int], list[int]]:
        caller = await async_caller(conn)
        db = await self.adatabase(caller, database)
        steps = db.store.cancel(ordered=self.dispatcher.ordered_families(), **selection)
        return await caller.drive(steps, "cancel")
