"""The producer-side Celery app of the django-celery-outbox peer (``CELERY_OUTBOX_APP``).

``OutboxCelery.send_task`` turns ``task.delay()`` into a row in the outbox table, in the
caller's ``transaction.atomic()``; its relay (``celery_outbox_relay``) then publishes the rows
on this app's broker. The tasks are executed by the benchmark's ordinary Celery worker
(``bench.app``: same task names, same broker, same worker command as the plain
Celery baseline), so only the path from the transaction to the broker differs.

Imported only in the benchmark's own venv, where django-celery-outbox is installed.
"""

from __future__ import annotations

from typing import Any

from django_celery_outbox import OutboxCelery

from bench.app import REDIS_URL

app: Any = OutboxCelery("outbox_bench_dco", broker=REDIS_URL)
app.conf.update(task_ignore_result=True)


@app.task(name="bench.noop", ignore_result=True)  # type: ignore[untyped-decorator]
def noop(n: int) -> None:
    """Runs in the benchmark worker, as ``bench.app.noop``."""


@app.task(name="bench.latency", ignore_result=True)  # type: ignore[untyped-decorator]
def latency(sent: float) -> None:
    """Runs in the benchmark worker, as ``bench.app.plain_latency``."""
