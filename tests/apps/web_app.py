"""The app of the outbox page's browser tests: a family that keeps delivered rows, so the page
can show a retried row delivered, and one whose handler fails three calls deep, so the page
can show where (``outbox-dispatch web --app tests.apps.web_app:...``)."""

from __future__ import annotations

from typing import Any

from outbox_dispatch import Context
from tests.apps.envapp import make_app

app, dispatcher = make_app("webtest", claim_interval=0.3)
dispatcher.family("kept", retention=3600, max_attempts=3)
dispatcher.family("billing", retention=3600, max_attempts=1)

VAT_RATES = {"DE": 0.19, "FR": 0.20}


@dispatcher.handler("web.notify", family="kept")
def notify(ctx: Context, payload: Any) -> None:
    pass


@dispatcher.handler("web.invoice", family="billing")
def invoice(ctx: Context, payload: Any) -> None:
    _invoice_total(payload)


def _invoice_total(payload: Any) -> float:
    return sum(_line_price(line, payload["country"]) for line in payload["lines"])


def _line_price(line: Any, country: str) -> float:
    return float(line["net"]) * (1 + _vat_rate_for(country))


def _vat_rate_for(country: str) -> float:
    return VAT_RATES[country]  # a KeyError three calls below the handler
