"""The Django app: add ``"outbox_dispatch.contrib.django"`` to ``INSTALLED_APPS`` and point
``OUTBOX_DISPATCHER`` at your Dispatcher (``"myproj.outbox:dispatcher"``)."""

from __future__ import annotations

import functools
from importlib import import_module

from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.dispatcher import Dispatcher
from outbox_dispatch.ops.appload import load_dispatcher

SETTING = "OUTBOX_DISPATCHER"
EXAMPLE = '"myproj.outbox:dispatcher"'


class OutboxDispatchConfig(AppConfig):  # type: ignore[misc]
    name = "outbox_dispatch.contrib.django"
    label = "outbox_dispatch"
    verbose_name = "Outbox dispatch"
    default = True

    def ready(self) -> None:
        import_module(f"{self.name}.checks")  # registers the system checks


def configured_spec() -> str | None:
    """The ``module:attribute`` of the Dispatcher, or None when the setting is unset or empty."""
    spec = getattr(settings, SETTING, None)
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        raise ImproperlyConfigured(
            f"settings.{SETTING} must be a 'module:attribute' string such as {EXAMPLE}, "
            f"got a {type(spec).__name__}"
        )
    return spec


def get_dispatcher() -> Dispatcher:
    """The Dispatcher named by ``settings.OUTBOX_DISPATCHER``, imported once per value (so
    ``override_settings`` in tests picks another one)."""
    spec = configured_spec()
    if spec is None:
        raise ImproperlyConfigured(
            f"settings.{SETTING} is not set: point it at the module attribute that holds your "
            f"outbox_dispatch.Dispatcher, for example {SETTING} = {EXAMPLE}"
        )
    return _load(spec)


@functools.lru_cache(maxsize=16)
def _load(spec: str) -> Dispatcher:
    # lru_cache keeps no exceptions: after a fix (or in the next request) the import is retried
    try:
        dispatcher, _module = load_dispatcher(spec)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"settings.{SETTING} = {spec!r}: {exc}") from exc
    return dispatcher
