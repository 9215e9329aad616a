"""The outbox in Django's admin: rows by family and state, searched by id, actor, command or
dedupe key, read-only (payload and last error included), with the operator's actions (retry
parked, purge parked, cancel) going through operations.py, the same code as the CLI."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from outbox_dispatch.contrib.django.apps import get_dispatcher
from outbox_dispatch.contrib.django.models import STATES, OutboxRow, bind_schema, readable
from outbox_dispatch.ops import actions as row_actions


class StateFilter(admin.SimpleListFilter):  # type: ignore[misc]
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _q) in STATES.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        chosen = STATES.get(self.value() or "")
        return queryset if chosen is None else queryset.filter(chosen[1])


@admin.register(OutboxRow)
class OutboxRowAdmin(admin.ModelAdmin):  # type: ignore[misc]
    list_display = ("id", "family", "command", "actor", "state", "attempts", "due", "error")
    list_filter = ("family", StateFilter)
    search_fields = ("actor", "command", "dedupe_key")  # the search box; get_search_results
    actions = ("retry_parked", "purge_parked", "cancel_rows", "pause_families", "resume_families")
    list_per_page = 50
    show_full_result_count = False  # a count(*) of a large outbox on every page is slow

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        bind_schema(get_dispatcher().schema)
        return readable(super().get_queryset(request))

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """A row id, an exact actor (through its per-family index) or dedupe key, or part of
        a command."""
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(family__in=sorted(get_dispatcher().families), actor=term)
        match |= Q(dedupe_key=term) | Q(command__icontains=term)
        if term.isascii() and term.isdigit() and len(term) < 19:
            match |= Q(id=int(term))
        return queryset.filter(match), False

    @admin.display(description="due at")  # type: ignore[untyped-decorator]
    def due(self, row: OutboxRow) -> Any:
        return getattr(row, "due", None) or "behind its actor's head"

    @admin.display(description="last error")  # type: ignore[untyped-decorator]
    def error(self, row: OutboxRow) -> str:
        text = row.last_error or ""
        return text if len(text) <= 80 else text[:77] + "..."

    # read-only: rows change through the Dispatcher only (a save would write every column
    # back, racing the worker that holds the row)
    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name if f.name != "due_at" else "due" for f in OutboxRow._meta.fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return self.get_fields(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # purge parked rows instead: it keeps ordered lines moving

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and bool(super().has_change_permission(request, obj))

    def _report(self, request: HttpRequest, done: row_actions.Done, verb: str) -> None:
        rows = "1 row" if len(done.ids) == 1 else f"{len(done.ids)} rows"
        self.message_user(request, f"{rows} {verb}", messages.SUCCESS)
        for reason in done.reasons:
            self.message_user(request, reason, messages.WARNING)

    @admin.action(description="Retry the selected parked rows", permissions=["change"])  # type: ignore[untyped-decorator]
    def retry_parked(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        done = row_actions.retry_parked(get_dispatcher(), ids, by=f"django admin: {request.user}")
        self._report(request, done, "due again")

    @admin.action(description="Purge the selected parked rows", permissions=["change"])  # type: ignore[untyped-decorator]
    def purge_parked(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        done = row_actions.purge_parked(get_dispatcher(), ids, by=f"django admin: {request.user}")
        self._report(request, done, "purged")

    @admin.action(description="Cancel the selected rows", permissions=["change"])  # type: ignore[untyped-decorator]
    def cancel_rows(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        done = row_actions.cancel(
            get_dispatcher(),
            ids,
            reason="cancelled in the Django admin",
            by=f"django admin: {request.user}",
        )
        self._report(request, done, "cancelled")
        if done.requested:
            self.message_user(request, f"running, asked to stop: {done.requested}", messages.INFO)

    @admin.action(description="Pause the families of the selected rows", permissions=["change"])  # type: ignore[untyped-decorator]
    def pause_families(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        families = sorted(set(queryset.values_list("family", flat=True)))
        dispatcher = get_dispatcher()
        for family in families:
            dispatcher.ops.pause(
                family, reason="paused in the Django admin", by=f"django admin: {request.user}"
            )
        self.message_user(request, f"paused: {', '.join(families)}", messages.SUCCESS)

    @admin.action(description="Resume the families of the selected rows", permissions=["change"])  # type: ignore[untyped-decorator]
    def resume_families(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        families = sorted(set(queryset.values_list("family", flat=True)))
        dispatcher = get_dispatcher()
        who = f"django admin: {request.user}"
        resumed = [f for f in families if dispatcher.ops.resume(f, by=who)]
        self.message_user(
            request, f"resumed: {', '.join(resumed) or 'none was paused'}", messages.SUCCESS
        )
