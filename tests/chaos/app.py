"""The Celery app of the chaos run's worker and claimer processes:
``celery -A tests.chaos.app worker``, configured by the ``CHAOS_*`` variables the
orchestrator sets (see ``workload.Settings``)."""

from __future__ import annotations

from outbox_dispatch.core.errors import ConfigurationError

from .workload import Settings, build

settings = Settings.from_env()
if not settings.database_url or not settings.redis_url:
    raise ConfigurationError(
        "the chaos app needs CHAOS_DATABASE_URL and CHAOS_REDIS_URL: it is started by "
        "scripts/chaos (python -m tests.chaos.run), which sets them"
    )
app, dispatcher = build(settings)
