"""A user's Celery app for the process tests, configured from the environment the tests set:
``celery -A tests.apps.app worker -B`` runs it as a separate process."""

from __future__ import annotations

import os
from typing import Any

from outbox_dispatch import Backoff, Context
from tests.apps.envapp import SCHEMA, make_app

app, dispatcher = make_app("acceptance", claim_interval=0.3)
dispatcher.family("custom", max_attempts=2, lease=10, backoff=Backoff(base=0.1, cap=0.2))


def _record(ctx: Context) -> None:
    with dispatcher.store.connection() as conn:
        conn.execute(
            f'INSERT INTO "{SCHEMA}".effects (row_id, command, attempt, pid)'
            " VALUES (%s, %s, %s, %s)",
            (ctx.row_id, ctx.command, ctx.attempt, os.getpid()),
        )


@dispatcher.handler("acc.email", family="intent")
def email(ctx: Context, payload: Any) -> None:
    _record(ctx)


@dispatcher.handler("acc.custom", family="custom")
def custom(ctx: Context, payload: Any) -> None:
    _record(ctx)
    if payload.get("fail"):
        raise RuntimeError("custom handler refuses this payload")
