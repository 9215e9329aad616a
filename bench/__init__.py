"""Benchmarks: outbox delivery against plain Celery on the same broker and worker settings."""
