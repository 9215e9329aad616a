"""The caller's connection in async code: psycopg 3's AsyncConnection and asyncpg (raw or
under SQLAlchemy's asyncio extension) await the same steps a sync Caller runs
(store/callers.py); asyncpg's ``$n`` placeholders are made from the SQL files' ``%(name)s``."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

from outbox_dispatch.core.errors import InvalidArgument
from outbox_dispatch.store.adapters import database_target
from outbox_dispatch.store.callers import (
    USE,
    Each,
    Exec,
    One,
    Row,
    Step,
    Steps,
    T,
    Target,
    driver_errors,
    failed,
    unusable,
)


class AsyncCaller(ABC):
    """An async driver's connection, as the outbox writes on it."""

    driver = ""

    def __init__(self, conn: Any, holder: object) -> None:
        self.conn = conn
        self.holder = holder
        self._target: Target | None = None

    async def drive(self, steps: Steps[T], action: str) -> T:
        with driver_errors(action):
            async with self.scope():
                answer: Any = None
                try:
                    while True:
                        answer = await self.run(steps.send(answer))
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]

    @abstractmethod
    async def run(self, step: Step) -> Any:
        """One statement awaited on this driver, with its answer."""

    @abstractmethod
    def scope(self) -> Any:
        """Statements that belong together (an async context manager)."""

    @abstractmethod
    async def target(self) -> Target | None:
        """Where the connection goes (host, port, database)."""


class AsyncPsycopg(AsyncCaller):
    driver = "psycopg (async)"

    async def run(self, step: Step) -> Any:
        if isinstance(step, Each):
            rows: list[Row | None] = []
            async with self.conn.cursor() as cur:
                await cur.executemany(step.sql, step.params, returning=True)
                for _ in step.params:
                    rows.append(await cur.fetchone())
                    cur.nextset()
            return rows
        cursor = await self.conn.execute(step.sql, step.params)
        if isinstance(step, Exec):
            return None
        return await (cursor.fetchone() if isinstance(step, One) else cursor.fetchall())

    @asynccontextmanager
    async def scope(self) -> AsyncIterator[None]:
        from psycopg.pq import TransactionStatus

        status = self.conn.info.transaction_status
        if status == TransactionStatus.INERROR:
            raise InvalidArgument(failed(self.driver))
        if self.conn.autocommit and status == TransactionStatus.IDLE:
            async with self.conn.transaction():
                yield
        else:
            yield

    async def target(self) -> Target | None:
        info = self.conn.info
        return database_target({"host": info.host, "port": info.port, "dbname": info.dbname})


class AsyncPG(AsyncCaller):
    """asyncpg: no autocommit flag (outside a transaction each statement commits alone) and
    ``$n`` placeholders."""

    driver = "asyncpg"

    async def run(self, step: Step) -> Any:
        sql, names = positional(step.sql)
        if isinstance(step, Each):
            out: list[Row | None] = []
            for params in step.params:
                found = await self.conn.fetchrow(sql, *(params[n] for n in names))
                out.append(None if found is None else tuple(found))
            return out
        args = [step.params[n] for n in names]
        if isinstance(step, Exec):
            await self.conn.execute(sql, *args)
            return None
        if isinstance(step, One):
            found = await self.conn.fetchrow(sql, *args)
            return None if found is None else tuple(found)
        return [tuple(r) for r in await self.conn.fetch(sql, *args)]

    @asynccontextmanager
    async def scope(self) -> AsyncIterator[None]:
        if self.conn.is_in_transaction():
            yield
        else:
            async with self.conn.transaction():
                yield

    async def target(self) -> Target | None:
        # asyncpg says where it connected only through private attributes: ask the server
        if self._target is None:
            row = await self.conn.fetchrow(
                "SELECT coalesce(host(inet_server_addr()), ''), "
                "coalesce(inet_server_port(), 5432)::text, current_database()"
            )
            self._target = database_target({"host": row[0], "port": row[1], "dbname": row[2]})
        return self._target


@cache
def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``%(name)s`` placeholders as asyncpg's ``$n`` (one number per name), ``%%`` as ``%``."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return re.sub(r"%%|%\((\w+)\)s", number, sql), tuple(names)


async def async_caller(conn: object) -> AsyncCaller:
    """The caller's connection for ``aenqueue``, ``aenqueue_many`` and ``acancel``."""
    raw = await _unwrap_async(conn)
    module = type(raw).__module__
    if module.startswith("asyncpg"):
        caller: AsyncCaller = AsyncPG(raw, conn)
        closed = raw.is_closed()
    elif module.startswith("psycopg") and type(raw).__name__.startswith("Async"):
        caller = AsyncPsycopg(raw, conn)
        closed = bool(raw.closed)
    elif module.startswith(("psycopg", "django", "sqlalchemy")):
        raise InvalidArgument(
            f"{type(conn).__name__} is a sync connection: call dispatcher.enqueue(...) (or "
            "enqueue_many, cancel) with it"
        )
    else:
        raise InvalidArgument(unusable(conn))
    if closed:
        raise InvalidArgument(f"the {caller.driver} connection passed is closed: {USE}")
    return caller


async def _unwrap_async(conn: Any) -> Any:
    """The driver connection inside SQLAlchemy's AsyncSession or AsyncConnection, with the
    SQLAlchemy transaction begun on the server (asyncpg begins only at a first statement)."""
    if not type(conn).__module__.startswith("sqlalchemy"):
        return conn
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()  # begins the session's transaction if it has none
    if not isinstance(conn, AsyncConnection):
        raise InvalidArgument(
            f"{type(conn).__name__} is a sync SQLAlchemy object: call dispatcher.enqueue(...) "
            "with it, or pass an AsyncSession or AsyncConnection to aenqueue"
        )
    raw: Any = (await conn.get_raw_connection()).driver_connection
    if type(raw).__module__.startswith("asyncpg") and not raw.is_in_transaction():
        from sqlalchemy import text

        await conn.execute(text("SELECT 1"))  # SQLAlchemy's asyncpg adapter begins here
    return raw
