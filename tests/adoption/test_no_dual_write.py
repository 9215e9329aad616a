"""A task call never silently writes its row apart from the caller's transaction: inside a
SQLAlchemy Session's or Connection's transaction it joins it without ``using`` (as in Django's
``atomic()``), and a call that commits on its own says so, once per call site, unless the app
chose that."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from outbox_dispatch import Dispatcher, OutboxTask
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")


class Rollback(Exception):
    pass


@pytest.fixture(params=["psycopg", "psycopg2"])
def engine(request: pytest.FixtureRequest, database_url: str) -> Iterator[Engine]:
    url = database_url.replace("postgresql://", f"postgresql+{request.param}://", 1)
    engine = create_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def task(celery_app: Celery) -> Callable[..., Any]:
    def make(**options: Any) -> Any:
        def noop() -> None:
            return None

        name = f"shop.s{uuid.uuid4().hex[:8]}"
        return celery_app.task(name=name, base=OutboxTask, **options)(noop)

    return make


def test_a_task_call_in_a_sqlalchemy_session_joins_its_transaction(
    dispatcher: Dispatcher, task: Callable[..., Any], engine: Engine, database_url: str
) -> None:
    strict = task(outbox_outside="raise")  # a call that joined nothing would raise
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        kept = strict.delay().row_id
        session.commit()
    with pytest.raises(Rollback), Session(engine) as session, session.begin():
        session.execute(text("SELECT 1"))
        dropped = strict.delay().row_id
        raise Rollback
    with pytest.raises(Rollback), engine.begin() as conn:  # Core, no ORM
        conn.execute(text("SELECT 1"))
        core = strict.delay().row_id
        raise Rollback
    schema = dispatcher.schema
    assert count_rows(database_url, schema, f"id = {kept}") == 1
    assert count_rows(database_url, schema, f"id IN ({dropped}, {core})") == 0
    with Session(engine) as session:  # a session whose transaction ended joins nothing
        session.execute(text("SELECT 1"))
        session.commit()
    with pytest.raises(Exception, match="outside a transaction"):
        strict.delay()


def _call(t: Any) -> int:
    return int(t.delay().row_id)


def test_a_call_that_commits_on_its_own_warns_once_per_call_site(
    dispatcher: Dispatcher,
    task: Callable[..., Any],
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert dispatcher.settings.task_outside is None  # nothing chosen: commit, and say so
    loose = task()
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        ids = [_call(loose) for _ in range(3)]  # one call site, three calls
        ids.append(int(loose.delay().row_id))  # another call site
    warned = [r for r in caplog.records if "outside any transaction" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in warned]
    assert "test_no_dual_write.py" in warned[0].getMessage()
    assert "using(conn)" in warned[0].getMessage()
    assert len(set(ids)) == 4  # four rows committed (a running worker may have delivered them)
    caplog.clear()
    chosen = task(outbox_outside="commit")  # chosen: no warning
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch"):
        chosen.delay()
    assert not [r for r in caplog.records if "outside any transaction" in r.getMessage()]
