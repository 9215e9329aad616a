# proj/tasks.py
import os
from datetime import timedelta
from typing import Any

import psycopg
from celery import Celery

from outbox_dispatch import Context, Dispatcher, OutboxTask, using

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

# task_cls=OutboxTask: a task's .delay() inside a transaction writes an outbox row there
app = Celery("proj", broker=REDIS_URL, task_cls=OutboxTask)
dispatcher = Dispatcher(app, database_url=DATABASE_URL, redis_url=REDIS_URL)
dispatcher.family("email", retention=timedelta(days=7))  # delivered rows and keys kept 7 days


@app.task(bind=True, max_retries=5)
def reserve_stock(self: Any, order_id: int) -> None:  # an existing Celery task, unchanged
    print(f"stock reserved for order {order_id} (attempt {self.request.retries + 1})")


@dispatcher.handler("email.receipt", family="email")  # or a handler of the outbox's own
def send_receipt(ctx: Context, payload: dict[str, Any]) -> None:
    print(f"receipt for order {payload['order']} (idempotency key {ctx.idempotency_key})")


def place_order(order_id: int) -> None:
    with psycopg.connect(DATABASE_URL) as conn, conn.transaction(), using(conn):
        conn.execute("UPDATE orders SET state = 'placed' WHERE id = %s", (order_id,))
        reserve_stock.delay(order_id)  # commits or rolls back with the order
        dispatcher.enqueue(
            conn,
            "email.receipt",
            {"order": order_id},
            actor=f"order:{order_id}",
            dedupe_key=f"receipt:{order_id}",  # placed twice: one receipt, for 7 days
        )
