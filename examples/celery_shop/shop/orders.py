"""Placing an order: the order, its charge and its receipt commit together or not at all.

The only outbox-specific line is ``using(conn)``, which tells the task calls whose
transaction they belong to (a Django shop needs none: ``transaction.atomic()`` is found).
"""

from __future__ import annotations

from outbox_dispatch import using

from .db import connect
from .tasks import charge_card, send_receipt


class OutOfStock(Exception):
    """The order cannot be filled."""


def place_order(customer: str, cents: int, *, in_stock: bool = True) -> int:
    with connect() as conn, conn.transaction(), using(conn):
        row = conn.execute(
            "INSERT INTO orders (customer, cents) VALUES (%s, %s) RETURNING id", (customer, cents)
        ).fetchone()
        assert row is not None
        order_id = int(row[0])
        charge_card.delay(order_id, cents)
        send_receipt.delay(order_id)
        if not in_stock:
            raise OutOfStock(f"order {order_id}")  # rolls back the order and both calls
    return order_id
