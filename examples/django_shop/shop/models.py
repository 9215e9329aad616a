"""An order, and what its tasks record about it."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]
    customer = models.CharField(max_length=100)
    cents = models.IntegerField()
    charge_attempts = models.IntegerField(default=0)
    paid = models.BooleanField(default=False)
    receipt_sent = models.BooleanField(default=False)
