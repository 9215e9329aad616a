"""The Celery side: settings, tasks, beat entries, bootsteps, task states, OutboxTask."""
