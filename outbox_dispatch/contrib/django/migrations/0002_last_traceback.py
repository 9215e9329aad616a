"""The traceback of a row's last failed attempt (the outbox's migration 0012): model state
only, no SQL runs (the table is the outbox's own)."""

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("outbox_dispatch", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="outboxrow",
            name="last_traceback",
            field=models.TextField(null=True),
        ),
    ]
