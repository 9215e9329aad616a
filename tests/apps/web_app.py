"""The app of the outbox page's browser test: a family that keeps delivered rows, so the page
can show a retried row delivered (``outbox-dispatch web --app tests.apps.web_app:...``)."""

from __future__ import annotations

from typing import Any

from outbox_dispatch import Context
from tests.apps.envapp import make_app

app, dispatcher = make_app("webtest", claim_interval=0.3)
dispatcher.family("kept", retention=3600, max_attempts=3)


@dispatcher.handler("web.notify", family="kept")
def notify(ctx: Context, payload: Any) -> None:
    pass
