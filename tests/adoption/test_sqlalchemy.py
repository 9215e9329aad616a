"""Enqueue through a SQLAlchemy Session or Connection: the row commits or rolls back with the
session's transaction."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox_dispatch import Dispatcher, InvalidArgument, OutboxTask, using
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects

pytestmark = pytest.mark.usefixtures("clean")


@pytest.fixture(scope="module")
def engine(database_url: str) -> Iterator[Engine]:
    eng = create_engine(database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def test_session_enqueue_commits_and_rolls_back_with_the_session(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    effects: Effects,
    engine: Engine,
    database_url: str,
) -> None:
    cmd = commands()
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        dispatcher.enqueue(session, cmd, {"n": "rolled back"})
        session.rollback()
    with Session(engine) as session, session.begin():
        row_id = dispatcher.enqueue(session, cmd, {"n": "kept"}, actor="order:1")
    with engine.begin() as connection:  # a Core Connection works too
        dispatcher.enqueue(connection, cmd, {"n": "core"})
    assert count_rows(database_url, dispatcher.schema) == 2
    dispatcher.drain(timeout=5)
    assert sorted(p["n"] for _, _, _, p in effects.calls) == ["core", "kept"]
    assert row_id in effects.rows(cmd)


def test_sqlalchemy_on_another_driver_is_refused_clearly(
    dispatcher: Dispatcher, commands: Callable[..., str]
) -> None:
    sqlite = create_engine("sqlite://")
    with Session(sqlite) as session, pytest.raises(InvalidArgument, match="psycopg 3"):
        dispatcher.enqueue(session, commands(), {})
    sqlite.dispose()


def test_a_task_call_inside_using_a_session_commits_and_rolls_back_with_it(
    dispatcher: Dispatcher, engine: Engine, database_url: str
) -> None:
    ran: list[str] = []
    name = f"shop.sa{time.monotonic_ns()}"

    def record(text: str) -> None:
        ran.append(text)

    note = dispatcher.app.task(name=name, base=OutboxTask)(record)
    with Session(engine) as session, using(session):
        session.execute(text("SELECT 1"))
        note.delay("rolled back")
        session.rollback()
    with Session(engine) as session, session.begin(), using(session):
        note.delay("kept")
    assert count_rows(database_url, dispatcher.schema) == 1
    dispatcher.drain(timeout=5)
    assert ran == ["kept"]
