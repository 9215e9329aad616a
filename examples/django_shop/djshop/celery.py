"""The project's Celery app, as Celery's Django guide writes it, plus the outbox.

The one changed line is ``task_cls=OutboxTask``: every ``@shared_task``'s ``.delay()`` inside
``transaction.atomic()`` now writes an outbox row that commits with the models. The
Dispatcher reads its database from ``DATABASES["default"]``.
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_dispatch import Dispatcher, OutboxTask
from outbox_dispatch.contrib.django import database_url

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djshop.settings")

app = Celery("djshop", task_cls=OutboxTask)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

dispatcher = Dispatcher(
    app,
    database_url=database_url("default"),
    schema=os.environ.get("DJSHOP_SCHEMA", "outbox"),
    claim_interval=0.5,
)
