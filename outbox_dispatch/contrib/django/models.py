"""The outbox table as a read-only Django model, for the admin (admin.py). Unmanaged: the
table belongs to ``outbox-dispatch migrate`` (or ``outbox_migrate``), never to Django's
migrations, and rows change only through the Dispatcher, so ordered lines stay intact.

The table's schema is the Dispatcher's, bound when the admin reads (``bind_schema``). A row
blocked behind its actor's head is due at 'infinity', which Python cannot hold: ``due_at`` is
only ever filtered on, and read through ``readable()``'s ``due`` (NULL for 'infinity')."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import F, Q, QuerySet, Value
from django.db.models.functions import Cast, Now, NullIf

from outbox_dispatch.core.rows import STATE_WORDS, state_of

# The states an operator filters by (core/rows.py's STATE_WORDS), as conditions on the row.
LIVE = Q(parked_at__isnull=True, cancelled_at__isnull=True, done_at__isnull=True)
CONDITIONS: dict[str, Q] = {
    "due": LIVE & Q(due_at__lte=Now(), waiting=False, blocked=False),
    "scheduled": LIVE & Q(due_at__gt=Now(), claim_token__isnull=True, waiting=False, blocked=False),
    "in_flight": LIVE & Q(due_at__gt=Now(), claim_token__isnull=False),
    "waiting": LIVE & Q(waiting=True),
    "blocked": LIVE & Q(blocked=True),
    "parked": Q(parked_at__isnull=False),
    "done": Q(done_at__isnull=False),
    "cancelled": Q(cancelled_at__isnull=False),
}
STATES: dict[str, tuple[str, Q]] = {k: (STATE_WORDS[k], q) for k, q in CONDITIONS.items()}


class OutboxRow(models.Model):  # type: ignore[misc]
    id = models.BigIntegerField(primary_key=True)
    family = models.TextField()
    command = models.TextField()
    actor = models.TextField(null=True)
    payload = models.JSONField()
    dedupe_key = models.TextField(null=True)
    due_at = models.DateTimeField()
    attempts = models.IntegerField()
    lost_attempts = models.IntegerField()
    claim_token = models.UUIDField(null=True)
    claimed_at = models.DateTimeField(null=True)
    started_at = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    last_traceback = models.TextField(null=True)  # the handler's, of the last failed attempt
    maybe_applied = models.BooleanField()
    progress = models.JSONField(null=True)
    waiting = models.BooleanField()
    blocked = models.BooleanField()
    created_at = models.DateTimeField()
    parked_at = models.DateTimeField(null=True)
    cancelled_at = models.DateTimeField(null=True)
    cancel_reason = models.TextField(null=True)
    cancelled_by = models.TextField(null=True)
    done_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = '"outbox"."outbox"'
        app_label = "outbox_dispatch"
        verbose_name = "outbox row"
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"row {self.id} ({self.family}:{self.command})"

    @property
    def state(self) -> str:
        """The row's state, in the words of the admin's filter (core/rows.py's state_of)."""
        from django.utils import timezone

        fields = {f: getattr(self, f) for f in _STATE_FIELDS}
        return STATE_WORDS[
            state_of({**fields, "due_at": getattr(self, "due", None)}, timezone.now())
        ]


_STATE_FIELDS = ("parked_at", "cancelled_at", "done_at", "waiting", "blocked", "claim_token")


def readable(rows: QuerySet[Any]) -> QuerySet[Any]:
    """Rows with ``due`` in place of ``due_at``, which may be 'infinity'."""
    infinity = Cast(Value("infinity"), models.DateTimeField())
    return rows.defer("due_at").annotate(due=NullIf(F("due_at"), infinity))


def bind_schema(schema: str) -> None:
    """Point the model at the Dispatcher's schema (an identifier it has checked)."""
    OutboxRow._meta.db_table = f'"{schema}"."outbox"'
