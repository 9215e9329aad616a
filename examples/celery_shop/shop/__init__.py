"""A small shop whose Celery tasks went through the outbox after a one-line change."""
