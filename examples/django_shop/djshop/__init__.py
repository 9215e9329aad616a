"""A Django project with Celery, as Celery's Django guide sets one up."""

from .celery import app as celery_app

__all__ = ["celery_app"]
