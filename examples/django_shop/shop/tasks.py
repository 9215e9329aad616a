"""The shop's tasks, written for plain Celery and left as they were."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db.models import F

from .models import Order


@shared_task(bind=True, max_retries=3)  # type: ignore[untyped-decorator]
def charge(self: Any, order_id: int) -> None:
    Order.objects.filter(pk=order_id).update(charge_attempts=F("charge_attempts") + 1)
    if self.request.retries == 0:  # the gateway times out on every first try
        raise self.retry(countdown=1, exc=TimeoutError(f"gateway timeout for order {order_id}"))
    Order.objects.filter(pk=order_id).update(paid=True)


@shared_task  # type: ignore[untyped-decorator]
def send_receipt(order_id: int) -> None:
    Order.objects.filter(pk=order_id).update(receipt_sent=True)
