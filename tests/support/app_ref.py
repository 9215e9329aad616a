"""A module the CLI can load with ``--app tests.support.app_ref:dispatcher``; tests set
``dispatcher`` to the session's dispatcher."""

from __future__ import annotations

from outbox_dispatch import Dispatcher

dispatcher: Dispatcher | None = None
