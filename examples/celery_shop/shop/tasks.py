"""The shop's Celery tasks, exactly as they were written for plain Celery."""

from __future__ import annotations

from typing import Any

from .celery import app
from .db import connect


class GatewayTimeout(ConnectionError):
    """The payment gateway did not answer."""


@app.task(bind=True, max_retries=3, default_retry_delay=5)  # type: ignore[untyped-decorator]
def charge_card(self: Any, order_id: int, cents: int) -> None:
    # this gateway times out on the first try of every charge
    ok = self.request.retries > 0
    with connect() as conn:
        conn.execute(
            "INSERT INTO charges (order_id, attempt, cents, ok) VALUES (%s, %s, %s, %s)",
            (order_id, self.request.retries + 1, cents, ok),
        )
    if not ok:
        raise self.retry(countdown=1, exc=GatewayTimeout(f"charging order {order_id}"))


@app.task(autoretry_for=(ConnectionError,), retry_backoff=True)  # type: ignore[untyped-decorator]
def send_receipt(order_id: int) -> None:
    with connect() as conn:
        conn.execute(
            "INSERT INTO receipts (order_id) VALUES (%s) ON CONFLICT DO NOTHING", (order_id,)
        )
