"""Every driver a Celery shop writes through, sync and async, against the real Postgres: a row
enqueued in the caller's transaction is delivered once that transaction commits, and a
rollback leaves nothing; what the outbox cannot write through is refused before anything is
written."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
from celery import Celery
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from outbox_dispatch import Dispatcher, InvalidArgument, Message, OutboxTask, using
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")

Write = Callable[[Dispatcher, str, bool], int]  # (dispatcher, command, commit) -> row id


class Rollback(Exception):
    """Raised inside a transaction block to roll it back."""


def _sa_url(database_url: str, driver: str) -> str:
    return database_url.replace("postgresql://", f"postgresql+{driver}://", 1)


def _psycopg(url: str) -> Write:
    def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        with psycopg.connect(url) as conn:
            row_id = d.enqueue(conn, cmd, {"n": 1})
            conn.commit() if commit else conn.rollback()
        return row_id

    return write


def _psycopg2(url: str) -> Write:
    def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        conn = psycopg2.connect(url)
        try:
            row_id = d.enqueue(conn, cmd, {"n": 1})
            conn.commit() if commit else conn.rollback()
        finally:
            conn.close()
        return row_id

    return write


def _sqlalchemy(url: str, driver: str) -> Write:
    def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        engine = create_engine(_sa_url(url, driver))
        try:
            with Session(engine) as session:
                row_id = d.enqueue(session, cmd, {"n": 1})
                session.commit() if commit else session.rollback()
        finally:
            engine.dispose()
        return row_id

    return write


def _async(make: Callable[[Dispatcher, str, bool], Coroutine[Any, Any, int]]) -> Write:
    def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        return asyncio.run(make(d, cmd, commit))

    return write


def _apsycopg(url: str) -> Write:
    async def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            row_id = await d.aenqueue(conn, cmd, {"n": 1})
            await (conn.commit() if commit else conn.rollback())
        return row_id

    return _async(write)


def _asyncpg(url: str) -> Write:
    async def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        conn = await asyncpg.connect(url)
        try:
            tx = conn.transaction()
            await tx.start()
            row_id = await d.aenqueue(conn, cmd, {"n": 1})
            await (tx.commit() if commit else tx.rollback())
        finally:
            await conn.close()
        return row_id

    return _async(write)


def _sqlalchemy_async(url: str, driver: str) -> Write:
    async def write(d: Dispatcher, cmd: str, commit: bool) -> int:
        from sqlalchemy.ext.asyncio import AsyncSession

        engine = create_async_engine(_sa_url(url, driver))
        try:
            async with AsyncSession(engine) as session:
                row_id = await d.aenqueue(session, cmd, {"n": 1})
                await (session.commit() if commit else session.rollback())
        finally:
            await engine.dispose()
        return row_id

    return _async(write)


DRIVERS: dict[str, Callable[[str], Write]] = {
    "psycopg": _psycopg,
    "psycopg2": _psycopg2,
    "sqlalchemy+psycopg": lambda url: _sqlalchemy(url, "psycopg"),
    "sqlalchemy+psycopg2": lambda url: _sqlalchemy(url, "psycopg2"),
    "psycopg async": _apsycopg,
    "asyncpg": _asyncpg,
    "sqlalchemy async+psycopg": lambda url: _sqlalchemy_async(url, "psycopg"),
    "sqlalchemy async+asyncpg": lambda url: _sqlalchemy_async(url, "asyncpg"),
}


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_a_committed_row_is_delivered_and_a_rolled_back_one_never_exists(
    driver: str,
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Any,
    database_url: str,
) -> None:
    write = DRIVERS[driver](database_url)
    cmd = commands()
    kept = write(dispatcher, cmd, True)
    dropped = write(dispatcher, cmd, False)
    assert count_rows(database_url, dispatcher.schema, f"id = {kept}") == 1
    assert count_rows(database_url, dispatcher.schema, f"id = {dropped}") == 0
    dispatcher.drain(timeout=10)
    assert effects.rows(cmd) == [kept]


def test_enqueue_many_and_cancel_on_psycopg2_and_asyncpg(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands()
    conn = psycopg2.connect(database_url)
    try:
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"i": i}) for i in range(3)])
        done = dispatcher.cancel(conn, ids[0], reason="test", by="psycopg2")
        conn.commit()
    finally:
        conn.close()
    assert done.cancelled == [ids[0]]

    async def on_asyncpg() -> tuple[list[int], list[int]]:
        aconn = await asyncpg.connect(database_url)
        try:
            async with aconn.transaction():
                more = await dispatcher.aenqueue_many(aconn, [Message(cmd, {"i": 9})])
                gone = await dispatcher.acancel(aconn, ids[1], by="asyncpg")
        finally:
            await aconn.close()
        return more, gone.cancelled

    more, cancelled = asyncio.run(on_asyncpg())
    assert cancelled == [ids[1]]
    left = f"id IN ({ids[2]}, {more[0]}) AND cancelled_at IS NULL"
    assert count_rows(database_url, dispatcher.schema, left) == 2
    assert count_rows(database_url, dispatcher.schema, "cancelled_at IS NOT NULL") == 2


@pytest.fixture
def task(celery_app: Celery) -> Any:
    def noop() -> None:
        return None

    name = f"shop.d{uuid.uuid4().hex[:8]}"
    return celery_app.task(name=name, base=OutboxTask, outbox_outside="raise")(noop)


def test_a_task_call_on_an_autocommit_connection_inside_its_transaction_rolls_back_with_it(
    dispatcher: Dispatcher, task: Any, database_url: str
) -> None:
    """psycopg 3 with autocommit=True inside ``conn.transaction()`` is in a transaction: the
    call joins it (the autocommit flag alone made it a row committed on its own)."""
    with psycopg.connect(database_url, autocommit=True) as conn, using(conn):
        with pytest.raises(Rollback), conn.transaction():
            row_id = task.delay().row_id
            raise Rollback
    assert count_rows(database_url, dispatcher.schema, f"id = {row_id}") == 0


def test_a_task_call_under_using_a_psycopg2_connection_commits_with_it(
    dispatcher: Dispatcher, task: Any, database_url: str
) -> None:
    conn = psycopg2.connect(database_url)
    try:
        with using(conn):
            kept = task.delay().row_id
        conn.commit()
        with using(conn):
            dropped = task.delay().row_id
        conn.rollback()
    finally:
        conn.close()
    assert count_rows(database_url, dispatcher.schema, f"id = {kept}") == 1
    assert count_rows(database_url, dispatcher.schema, f"id = {dropped}") == 0


@contextmanager
def _nothing_written(database_url: str, schema: str) -> Iterator[None]:
    before = count_rows(database_url, schema)
    yield
    assert count_rows(database_url, schema) == before


def test_what_the_outbox_cannot_write_through_is_refused_and_nothing_is_written(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str
) -> None:
    cmd = commands()
    with _nothing_written(database_url, dispatcher.schema):
        with pytest.raises(InvalidArgument, match=r"cannot write through a sqlite3\.Connection"):
            dispatcher.enqueue(sqlite3.connect(":memory:"), cmd, {})  # type: ignore[arg-type]
        closed = psycopg2.connect(database_url)
        closed.close()
        with pytest.raises(InvalidArgument, match="psycopg2 connection passed is closed"):
            dispatcher.enqueue(closed, cmd, {})
        with psycopg.connect(database_url) as conn:
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1/0")
            with pytest.raises(InvalidArgument, match="failed earlier and can only be rolled"):
                dispatcher.enqueue(conn, cmd, {})
            with pytest.raises(InvalidArgument, match="is a sync connection: call dispatcher"):
                asyncio.run(dispatcher.aenqueue(conn, cmd, {}))

        async def async_to_sync() -> None:
            async with await psycopg.AsyncConnection.connect(database_url) as aconn:
                with pytest.raises(InvalidArgument, match="is an async connection: await"):
                    dispatcher.enqueue(aconn, cmd, {})  # type: ignore[arg-type]

        asyncio.run(async_to_sync())


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg async", "sqlalchemy async+asyncpg"])
def test_task_calls_in_async_code_commit_and_roll_back_with_the_transaction(
    driver: str, dispatcher: Dispatcher, task: Any, database_url: str
) -> None:
    async def call_in(commit: bool) -> int:
        if driver == "asyncpg":
            conn = await asyncpg.connect(database_url)
            tx = conn.transaction()
            await tx.start()
            async with using(conn):
                row_id = (await task.adelay()).row_id
            await (tx.commit() if commit else tx.rollback())
            await conn.close()
        elif driver == "psycopg async":
            async with await psycopg.AsyncConnection.connect(database_url) as aconn:
                async with using(aconn):
                    row_id = (await task.aapply_async((), {}, countdown=0)).row_id
                await (aconn.commit() if commit else aconn.rollback())
        else:
            from sqlalchemy.ext.asyncio import AsyncSession

            engine = create_async_engine(_sa_url(database_url, "asyncpg"))
            async with AsyncSession(engine) as session:
                async with using(session):
                    row_id = (await task.adelay()).row_id
                await (session.commit() if commit else session.rollback())
            await engine.dispose()
        return int(row_id)

    kept, dropped = asyncio.run(call_in(True)), asyncio.run(call_in(False))
    assert count_rows(database_url, dispatcher.schema, f"id = {kept}") == 1
    assert count_rows(database_url, dispatcher.schema, f"id = {dropped}") == 0


def test_a_sync_call_under_an_async_binding_or_an_async_call_without_one_is_refused(
    task: Any, database_url: str
) -> None:
    async def attempt() -> None:
        aconn = await asyncpg.connect(database_url)
        try:
            async with aconn.transaction(), using(aconn):
                with pytest.raises(InvalidArgument, match=r"await task\.adelay"):
                    task.delay()
        finally:
            await aconn.close()
        with pytest.raises(Exception, match=r"async with outbox_dispatch\.using"):
            await task.adelay()

    asyncio.run(attempt())
