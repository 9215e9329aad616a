"""Settings of the test project: the test Postgres (``OUTBOX_TEST_DATABASE_URL``), Django's
tables in ``OUTBOX_TEST_DJANGO_SCHEMA`` (the session's schema) through the search_path."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

from tests.conftest import DATABASE_URL

_db = conninfo_to_dict(DATABASE_URL)
_schema = os.environ.get("OUTBOX_TEST_DJANGO_SCHEMA", "public")

SECRET_KEY = "outbox-dispatch-tests-only"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outbox_dispatch.contrib.django",
    "tests.django_project.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "tests.django_project.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        "OPTIONS": {"options": f"-c search_path={_schema}"},
    }
}
# a second alias on the same database (a shop's named database), and one on another database
DATABASES["orders"] = dict(DATABASES["default"])
DATABASES["elsewhere"] = {**DATABASES["default"], "NAME": "postgres"}
OUTBOX_DISPATCHER = "tests.django_project.outbox:dispatcher"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Django's tasks framework on the outbox (tests/adoption/test_django_tasks.py): the default
# queue's rows in family "django_tasks", and a second queue, "emails"
TASKS = {
    "default": {
        "BACKEND": "outbox_dispatch.contrib.django.tasks.OutboxBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"FAMILY": "django_tasks"},
    }
}
