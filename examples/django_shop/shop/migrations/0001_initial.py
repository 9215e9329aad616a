from __future__ import annotations

from typing import Any

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[Any] = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("customer", models.CharField(max_length=100)),
                ("cents", models.IntegerField()),
                ("charge_attempts", models.IntegerField(default=0)),
                ("paid", models.BooleanField(default=False)),
                ("receipt_sent", models.BooleanField(default=False)),
            ],
        ),
    ]
