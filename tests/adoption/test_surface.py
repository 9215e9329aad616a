"""The public surface as a reader of the docs meets it: every error docs/api.md names imports
from ``outbox_dispatch``; ``ctx.is_cancelled`` reads the same as a bool and as a call; one
Celery app gets one Dispatcher, said at construction."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import outbox_dispatch
from outbox_dispatch import ConfigurationError, Context, Dispatcher

API = Path(__file__).parents[2] / "docs" / "api.md"


def test_every_error_the_api_page_names_imports_from_the_package() -> None:
    text = API.read_text("utf-8")
    errors = text[text.index("Errors (all `OutboxError`)") :].split("\n\n")[0]
    names = set(re.findall(r"`([A-Z][A-Za-z]+)`", errors))
    assert {"UnknownDatabase", "DatabaseUnavailable", "StatementCancelled"} <= names
    missing = sorted(n for n in names if not hasattr(outbox_dispatch, n))
    assert not missing, f"docs/api.md names errors outbox_dispatch does not export: {missing}"
    assert all(issubclass(getattr(outbox_dispatch, n), Exception) for n in names)


def test_is_cancelled_reads_as_a_bool_and_as_a_call(
    dispatcher: Dispatcher, commands: Callable[..., str], effects: Any, conn: Any
) -> None:
    seen: list[tuple[bool, bool]] = []

    def handler(ctx: Context, payload: Any) -> None:
        seen.append((bool(ctx.is_cancelled), ctx.is_cancelled()))
        ctx.cancelled.set()
        seen.append((bool(ctx.is_cancelled), ctx.is_cancelled()))

    cmd = commands(fn=handler)
    with conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    dispatcher.drain(timeout=10)
    assert effects.rows(cmd) == [row_id]  # called, it did not fail the attempt
    assert seen == [(False, False), (True, True)]


def test_a_second_dispatcher_on_one_app_is_refused(database_url: str) -> None:
    app = Celery("one_app", broker="memory://", set_as_current=False)
    Dispatcher(app, database_url=database_url, schema="first")
    with pytest.raises(ConfigurationError, match="already has a Dispatcher: build one per app"):
        Dispatcher(app, database_url=database_url, schema="second")
