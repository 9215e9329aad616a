"""``manage.py outbox_migrate``: the outbox's own SQL migrations, which Django's ``migrate``
does not see (they are versioned SQL files, not Django migrations)."""

from __future__ import annotations

from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox_dispatch.contrib.django.apps import get_dispatcher
from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.migrations import applied_versions, migrate
from outbox_dispatch.store.sqlfiles import Migration, migrations


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "Apply outbox_dispatch's SQL migrations to the schema of settings.OUTBOX_DISPATCHER's "
        "Dispatcher, on the Dispatcher's database_url. Django's migrate does not know these "
        "files: run this once per deploy next to migrate. Safe to repeat, and to run from "
        "several machines at once (an advisory lock serializes them)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--check",
            action="store_true",
            help="Apply nothing; exit with status 1 when migrations are pending (2 when the "
            "database cannot be reached).",
        )
        parser.add_argument(
            "--database-url",
            help="Migrate as another role than the Dispatcher's (the migrate role of the "
            "least-privilege layout: outbox-dispatch roles).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.quiet = options["verbosity"] < 1
        dispatcher = get_dispatcher()
        url = options.get("database_url") or dispatcher.database_url
        where = f"schema {dispatcher.schema!r} on {mask_dsn(url)}"
        try:
            if options["check"]:
                missing = pending(url, dispatcher.schema)
                if missing:
                    raise CommandError(
                        f"{len(missing)} outbox migrations pending in {where}: "
                        f"{', '.join(_name(m) for m in missing)}; run manage.py outbox_migrate",
                        returncode=1,
                    )
                self._say(f"outbox {where} is up to date")
                return
            applied = set(migrate(url, dispatcher.schema))
        except (psycopg.Error, OutboxError) as exc:
            doing = "check" if options["check"] else "migrate"
            raise CommandError(
                f"cannot {doing} the outbox {where}: {mask_dsn(str(exc))}", returncode=2
            ) from exc
        if not applied:
            self._say(f"outbox {where} is up to date")
            return
        for migration in migrations():
            if migration.version in applied:
                self._say(f"applied {_name(migration)}", success=True)
        self._say(f"outbox {where} migrated")

    def _say(self, text: str, *, success: bool = False) -> None:
        if not self.quiet:
            self.stdout.write(self.style.SUCCESS(text) if success else text)


def pending(database_url: str, schema: str) -> list[Migration]:
    """Migrations not yet applied to the schema (all of them on a fresh one)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        done = applied_versions(conn, schema)
    return [m for m in migrations() if m.version not in done]


def _name(migration: Migration) -> str:
    return f"{migration.version:04d}_{migration.name}"
