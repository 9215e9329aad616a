"""The business change that an outbox row must commit (or roll back) with."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]
    customer = models.CharField(max_length=100)
    total_cents = models.IntegerField()

    class Meta:
        app_label = "shop"
