"""The shop's settings: its database and broker from the environment."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(
    os.environ.get("DJSHOP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
)
_schema = os.environ.get("DJSHOP_SCHEMA", "public")

SECRET_KEY = os.environ.get("DJSHOP_SECRET_KEY", "example-only")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "outbox_dispatch.contrib.django",
    "shop",
]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "djshop.urls"
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
OUTBOX_DISPATCHER = "djshop.celery:dispatcher"
CELERY_BROKER_URL = os.environ.get("DJSHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": os.environ.get("DJSHOP_KEY_PREFIX", "")}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
