"""Finds the user's Dispatcher from ``module:attribute``, as ``celery -A`` finds an app."""

from __future__ import annotations

import importlib
import os
import sys

from outbox_dispatch.core.errors import ConfigurationError
from outbox_dispatch.dispatcher import Dispatcher

APP_ENV = "OUTBOX_DISPATCH_APP"


def load_dispatcher(spec: str | None) -> tuple[Dispatcher, str]:
    """Return the dispatcher and the module that holds it (for ``celery -A``)."""
    spec = spec or os.environ.get(APP_ENV)
    if not spec:
        raise ConfigurationError(
            f"no app given: pass --app module:attribute or set {APP_ENV} "
            "(for example --app proj.tasks:dispatcher)"
        )
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like celery -A: the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error, or the module failing as it loads
        raise ConfigurationError(
            f"cannot import {module_name!r} from --app {spec!r}: {exc}"
        ) from exc
    if attr:
        try:
            found = getattr(module, attr)
        except AttributeError as exc:
            raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}") from exc
        dispatcher = getattr(found, "outbox_dispatcher", found)
        if not isinstance(dispatcher, Dispatcher):
            raise ConfigurationError(
                f"{spec!r} is a {type(found).__name__}, not a Dispatcher or a Celery app "
                "that a Dispatcher was built on"
            )
        return dispatcher, module_name
    candidates = [v for v in vars(module).values() if isinstance(v, Dispatcher)]
    if len(candidates) != 1:
        raise ConfigurationError(
            f"module {module_name!r} holds {len(candidates)} Dispatcher objects: "
            "name one with --app module:attribute"
        )
    return candidates[0], module_name
