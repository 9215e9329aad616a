"""The unmanaged outbox row model's state: no SQL runs (the table is the outbox's own)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[Any] = []
    operations = [
        migrations.CreateModel(
            name="OutboxRow",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("family", models.TextField()),
                ("command", models.TextField()),
                ("actor", models.TextField(null=True)),
                ("payload", models.JSONField()),
                ("dedupe_key", models.TextField(null=True)),
                ("due_at", models.DateTimeField()),
                ("attempts", models.IntegerField()),
                ("lost_attempts", models.IntegerField()),
                ("claim_token", models.UUIDField(null=True)),
                ("claimed_at", models.DateTimeField(null=True)),
                ("started_at", models.DateTimeField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("maybe_applied", models.BooleanField()),
                ("progress", models.JSONField(null=True)),
                ("waiting", models.BooleanField()),
                ("blocked", models.BooleanField()),
                ("created_at", models.DateTimeField()),
                ("parked_at", models.DateTimeField(null=True)),
                ("cancelled_at", models.DateTimeField(null=True)),
                ("cancel_reason", models.TextField(null=True)),
                ("cancelled_by", models.TextField(null=True)),
                ("done_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "outbox row",
                "ordering": ["-id"],
                "managed": False,
                "db_table": '"outbox"."outbox"',
            },
        ),
    ]
