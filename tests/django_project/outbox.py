"""What ``settings.OUTBOX_DISPATCHER`` points at. Fixtures set these to dispatchers built on
the session's Celery app and schema, as a project's ``outbox.py`` would build its own.
get_dispatcher() imports each name once per process and keeps what it found, so each
dispatcher has a name of its own: a name given a second dispatcher would still serve the
first (test_django's ``_served`` refuses that)."""

from __future__ import annotations

from outbox_dispatch import Dispatcher

dispatcher: Dispatcher | None = None  # listen=False: enqueue wakes the claimer on commit
listening: Dispatcher | None = None  # listen=True (the NOTIFY is the wake), an ordered family
fresh: Dispatcher | None = None  # a schema nobody migrated yet
unreachable: Dispatcher | None = None  # a database nobody listens on
other_role: Dispatcher | None = None  # the session's schema, its own URL unreachable
