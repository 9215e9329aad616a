"""The outbox in Django's admin, through Django's test client against the real Postgres:
rows filtered by state, searched by id, actor and dedupe key, read-only detail pages, and
the actions (retry and purge parked, cancel) through the same code as the CLI, keeping an
ordered actor's line moving."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from outbox_dispatch import Context, Dispatcher, PermanentFailure
from tests.support.django_setup import _served

pytestmark = pytest.mark.usefixtures("clean")

CHANGELIST = "/admin/outbox_dispatch/outboxrow/"


@pytest.fixture(scope="module")
def staff(order_model: Any) -> Client:
    """A logged-in superuser; Django's own tables migrated into the session's schema."""
    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_superuser("ops", "ops@example.com", "not-used")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(scope="module")
def delivered(listening: Dispatcher) -> list[int]:
    """The rows of the ordered family 'lined' delivered; ``{"fail": true}`` rows park."""
    seen: list[int] = []

    def lined(ctx: Context, payload: Any) -> None:
        if payload.get("fail"):
            raise PermanentFailure("the warehouse refused it")
        seen.append(ctx.row_id)

    listening.handler("dj.lined", family="lined")(lined)
    return seen


@pytest.fixture
def admin_dispatcher(listening: Dispatcher, delivered: list[int]) -> Iterator[Dispatcher]:
    """The admin serves the dispatcher with an ordered family ('lined')."""
    delivered.clear()
    with _served("listening", listening):
        yield listening


def _ids(html: str) -> set[int]:
    return {int(i) for i in re.findall(r'name="_selected_action" value="(\d+)"', html)}


def _act(client: Client, action: str, ids: list[int]) -> str:
    response = client.post(
        CHANGELIST, {"action": action, "_selected_action": [str(i) for i in ids]}, follow=True
    )
    assert response.status_code == 200
    # the messages, as Django shows them (it capitalises the first letter)
    return str(response.content.decode()).lower()


def test_rows_by_state_and_search_and_a_read_only_row(
    staff: Client, admin_dispatcher: Dispatcher, database_url: str
) -> None:
    from django.core.checks import run_checks

    assert [m.id for m in run_checks() if m.id.startswith("admin.")] == []  # a valid ModelAdmin
    d = admin_dispatcher
    with psycopg.connect(database_url) as conn, conn.transaction():
        first = d.enqueue(conn, "dj.lined", {"fail": True}, actor="customer:1")
        behind = d.enqueue(conn, "dj.lined", {"n": 2}, actor="customer:1")
        later = d.enqueue(
            conn,
            "dj.lined",
            {"n": 3},
            actor="customer:2",
            delay=timedelta(hours=1),
            dedupe_key="nightly:7",
        )
    d.drain(timeout=10)  # the first row parks; the one behind it is blocked by it
    page = staff.get(CHANGELIST).content.decode()
    assert {first, behind, later} <= _ids(page)
    by_state = {
        state: _ids(staff.get(CHANGELIST, {"state": state}).content.decode())
        for state in ("parked", "blocked", "scheduled", "due", "done", "cancelled")
    }
    assert by_state["parked"] == {first}
    assert by_state["blocked"] == {behind}
    assert by_state["scheduled"] == {later}
    assert by_state["due"] == by_state["done"] == by_state["cancelled"] == set()
    assert _ids(staff.get(CHANGELIST, {"q": str(first)}).content.decode()) == {first}
    assert _ids(staff.get(CHANGELIST, {"q": "customer:1"}).content.decode()) == {first, behind}
    assert _ids(staff.get(CHANGELIST, {"q": "nightly:7"}).content.decode()) == {later}
    detail = staff.get(f"{CHANGELIST}{first}/change/")
    html = detail.content.decode()
    assert detail.status_code == 200
    assert "the warehouse refused it" in html and "&quot;fail&quot;: true" in html
    assert 'name="_save"' not in html  # read-only: nothing to save
    assert staff.get(f"{CHANGELIST}add/").status_code == 403


def test_actions_retry_purge_and_cancel_keep_the_line_and_say_why_not(
    staff: Client, admin_dispatcher: Dispatcher, delivered: list[int], database_url: str
) -> None:
    d = admin_dispatcher
    with psycopg.connect(database_url) as conn, conn.transaction():
        head = d.enqueue(conn, "dj.lined", {"fail": True}, actor="customer:5")
        behind = d.enqueue(conn, "dj.lined", {"n": 2}, actor="customer:5")
        other = d.enqueue(conn, "dj.lined", {"fail": True}, actor="customer:6")
        later = d.enqueue(conn, "dj.lined", {}, actor="customer:7", delay=timedelta(hours=1))
    d.drain(timeout=10)
    # purging the parked head lets the row behind it run (the CLI's own code does it)
    html = _act(staff, "purge_parked", [head, behind])
    assert "1 row purged" in html
    assert f"row {behind} is not parked: only parked rows can be retried" in html
    d.drain(timeout=10)
    assert delivered == [behind]
    # retrying a parked row runs it again (it parks again: its payload still fails)
    html = _act(staff, "retry_parked", [other])
    assert "1 row due again" in html
    # cancelling a scheduled row settles it at once; a parked row is refused with the reason
    html = _act(staff, "cancel_rows", [later])
    assert "1 row cancelled" in html
    with psycopg.connect(database_url) as conn:
        found = conn.execute(
            f'SELECT cancelled_by, cancel_reason FROM "{d.schema}".outbox WHERE id = %s',
            (later,),
        ).fetchone()
    assert found == ("django admin: ops", "cancelled in the Django admin")
    d.drain(timeout=10)  # the retried row fails again and parks again
    html = _act(staff, "cancel_rows", [other])
    assert "0 rows cancelled" in html
    assert f"row {other} is parked: parked rows are purged, not cancelled" in html
