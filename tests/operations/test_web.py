"""The outbox page's guards and pages as WSGI calls against the real Postgres: no request
without the credentials, no action without the page's token or from another site's form,
and what each page shows (the browser test, tests/operations/test_web_browser.py, clicks
through)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import psycopg
import pytest

from outbox_dispatch import ConfigurationError, Dispatcher
from outbox_dispatch.ops.web import WebApp, parse_credentials
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")

AUTH = "Basic " + base64.b64encode(b"ops:s3cret").decode()


def call(
    app: WebApp,
    method: str,
    path: str,
    *,
    query: str = "",
    form: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, str], str]:
    body = urlencode(form or {}, doseq=True).encode()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "HTTP_HOST": "127.0.0.1:8080",
        **(headers if headers is not None else {"HTTP_AUTHORIZATION": AUTH}),
    }
    seen: dict[str, Any] = {}

    def start(status: str, hdrs: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    out = b"".join(app(environ, start)).decode()
    return seen["status"], seen["headers"], out


@pytest.fixture
def web(dispatcher: Dispatcher) -> WebApp:
    return WebApp(dispatcher, user="ops", password="s3cret")


def _parked(database_url: str, schema: str, n: int = 1) -> list[int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
            " last_error, last_traceback, actor) SELECT 'quick', 't.web', '{\"n\": 1}', now(),"
            " 3, 'ConnectionError: <b>down</b>', 'File \"shop.py\", line 9, in <send_mail>',"
            " 'shop:1' FROM generate_series(1, %s) RETURNING id",
            (n,),
        ).fetchall()
    return [int(r[0]) for r in rows]


def test_it_refuses_to_start_without_credentials() -> None:
    for bad in (None, "", "ops", "ops:", ":pw"):
        with pytest.raises(ConfigurationError, match="never runs open"):
            parse_credentials(bad)
    assert parse_credentials("ops:a:b") == ("ops", "a:b")


def test_every_request_needs_the_credentials(web: WebApp) -> None:
    for headers in (
        {},
        {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"ops:no").decode()},
        {"HTTP_AUTHORIZATION": "Bearer x"},
        {"HTTP_AUTHORIZATION": "Basic !!"},
    ):
        status, hdrs, _ = call(web, "GET", "/", headers=headers)
        assert status.startswith("401") and "Basic" in hdrs["WWW-Authenticate"]
    status, hdrs, page = call(web, "GET", "/")
    assert status.startswith("200") and "<td>quick</td>" in page
    assert (
        hdrs["X-Frame-Options"] == "DENY"
        and "default-src 'none'" in hdrs["Content-Security-Policy"]
    )


def test_an_action_without_the_token_or_from_another_site_is_refused(
    web: WebApp, database_url: str, schema: str
) -> None:
    [row] = _parked(database_url, schema)
    for form, extra in (
        ({"id": row}, {}),  # no token
        ({"id": row, "token": "0" * 64}, {}),  # a forged one
        ({"id": row, "token": web.token()}, {"HTTP_ORIGIN": "https://evil.example"}),
        ({"id": row, "token": web.token()}, {"HTTP_ORIGIN": "null"}),  # a sandboxed frame
        ({"id": row, "token": web.token()}, {"HTTP_SEC_FETCH_SITE": "cross-site"}),
    ):
        status, _, text = call(
            web, "POST", "/purge", form=form, headers={"HTTP_AUTHORIZATION": AUTH, **extra}
        )
        assert status.startswith("403") and "refused" in text
    assert count_rows(database_url, schema, f"id = {row}") == 1  # nothing happened
    status, _, _ = call(web, "GET", "/purge")
    assert status.startswith("405")


def test_pages_escape_what_they_show_and_actions_say_what_happened(
    web: WebApp,
    dispatcher: Dispatcher,
    database_url: str,
    schema: str,
    conn: Any,
    commands: Callable[..., str],
) -> None:
    parked = _parked(database_url, schema, 2)
    _, _, page = call(web, "GET", "/parked")
    assert "&lt;b&gt;down&lt;/b&gt;" in page and "<b>down</b>" not in page
    _, _, page = call(web, "GET", "/rows", query=f"q={parked[1]}")  # the handler's traceback
    assert "<h3>traceback</h3>" in page and "in &lt;send_mail&gt;" in page
    status, hdrs, _ = call(web, "POST", "/retry", form={"id": parked[0], "token": web.token()})
    assert status.startswith("303") and hdrs["Location"].startswith(f"/rows?q={parked[0]}")
    _, _, page = call(web, "GET", "/rows", query=hdrs["Location"].split("?", 1)[1])
    assert "1 row due again (attempts reset)" in page and f"row {parked[0]}: due" in page
    # a row that is not parked cannot be purged: the reason is shown
    status, hdrs, _ = call(
        web, "POST", "/purge", form={"id": [parked[0], parked[1]], "token": web.token()}
    )
    _, _, page = call(web, "GET", "/parked", query=hdrs["Location"].split("?", 1)[1])
    assert "1 row purged" in page and f"row {parked[0]} is not parked" in page
    # find by dedupe key, with the row's history, then cancel it
    cmd = commands(family="quick")
    with conn.transaction():
        later = dispatcher.enqueue(
            conn, cmd, {"n": 2}, actor="shop:2", dedupe_key="web:7", delay=timedelta(hours=1)
        )
    _, _, page = call(web, "GET", "/rows", query="q=web:7")
    assert f"row {later}: scheduled" in page and "enqueued (command" in page
    status, hdrs, _ = call(web, "POST", "/cancel", form={"id": later, "token": web.token()})
    _, _, page = call(web, "GET", "/rows", query=hdrs["Location"].split("?", 1)[1])
    assert "1 row cancelled" in page and "cancelled by outbox page: ops" in page
    _, _, page = call(web, "GET", "/rows", query="q=no-such-key")
    assert "no row has the id, actor or dedupe key no-such-key" in page


def test_odd_input_gets_an_answer_not_a_crash(web: WebApp, dispatcher: Dispatcher) -> None:
    from outbox_dispatch.ops import actions

    status, _, page = call(web, "POST", "/retry", form={"id": "²", "token": web.token()})
    assert status.startswith("200") and "is not a row id" in page
    status, _, _ = call(web, "POST", "/retry", form={"id": "1", "token": "é"})
    assert status.startswith("403")
    status, _, page = call(web, "GET", "/rows", query="q=%C2%B2")
    assert status.startswith("200") and "no row has the id" in page
    with pytest.raises(ConfigurationError):
        WebApp(dispatcher, user="", password="")
    # an empty selection (the admin's rows were deleted meanwhile) cancels nothing
    assert actions.cancel(dispatcher, [], by="test").reasons == ["no row named"]


def test_a_link_cannot_put_words_on_the_page(web: WebApp) -> None:
    _, _, page = call(web, "GET", "/", query="ok=Row+5+was+verified+safe&warn=Purge+all+now")
    assert "verified safe" not in page and "Purge all now" not in page


def test_a_family_is_paused_and_resumed_from_the_page(web: WebApp, dispatcher: Dispatcher) -> None:
    form = {"family": "quick", "reason": "<i>provider</i> down", "token": web.token()}
    status, hdrs, _ = call(web, "POST", "/pause", form=form)
    assert status.startswith("303")
    _, _, page = call(web, "GET", "/", query=hdrs["Location"].split("?", 1)[1])
    assert "family quick paused" in page and "PAUSED" in page
    assert "&lt;i&gt;provider&lt;/i&gt; down" in page and "outbox page: ops" in page
    assert [p["family"] for p in dispatcher.ops.paused()] == ["quick"]
    status, hdrs, _ = call(web, "POST", "/resume", form={"family": "quick", "token": web.token()})
    _, _, page = call(web, "GET", "/", query=hdrs["Location"].split("?", 1)[1])
    assert "family quick resumed" in page and dispatcher.ops.paused() == []
    status, _, _ = call(web, "POST", "/pause", form={"family": "quick"})  # no token
    assert status.startswith("403") and dispatcher.ops.paused() == []


def test_the_parked_page_acts_on_a_selection_after_showing_its_count(
    web: WebApp, dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    parked = _parked(database_url, schema, 3)
    _, _, page = call(web, "GET", "/parked", query="error=down&family=quick")
    assert "3 parked rows match this selection" in page and "retry all 3 matching rows" in page
    assert count_rows(database_url, schema, "parked_at IS NOT NULL") == 3  # shown, not done
    form = {"action": "purge", "error": "down", "family": "quick", "token": web.token()}
    status, hdrs, _ = call(web, "POST", "/bulk", form=form)
    _, _, page = call(web, "GET", "/parked", query=hdrs["Location"].split("?", 1)[1])
    assert "3 rows purged" in page
    assert count_rows(database_url, schema, f"id IN ({parked[0]}, {parked[1]}, {parked[2]})") == 0
    assert dispatcher.ops.audit_log(limit=1)[0]["by"] == "outbox page: ops"
    status, _, _ = call(web, "POST", "/bulk", form={**form, "token": "0" * 64})
    assert status.startswith("403")


def test_a_read_only_credential_sees_everything_and_acts_on_nothing(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    app = WebApp(dispatcher, user="ops", password="s3cret", viewer=("audit", "r3ad"))
    viewer = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"audit:r3ad").decode()}
    [row] = _parked(database_url, schema, 1)
    status, _, page = call(app, "GET", "/parked", headers=viewer)
    assert status.startswith("200") and "down" in page
    for path, form in (
        ("/purge", {"id": row}),
        ("/pause", {"family": "quick"}),
        ("/bulk", {"action": "purge", "family": "quick", "error": "down"}),
    ):
        status, _, text = call(
            app, "POST", path, form={**form, "token": app.token()}, headers=viewer
        )
        assert status.startswith("403") and "read-only" in text
    assert count_rows(database_url, schema, f"id = {row}") == 1 and dispatcher.ops.paused() == []
    status, _, _ = call(app, "POST", "/purge", form={"id": row, "token": app.token()})
    assert status.startswith("303")  # the operator's credential acts


def _parked_as(
    database_url: str, schema: str, command: str, actor: str, error: str, age: str
) -> int:
    """A parked row of ``quick`` with its own command, actor, last error and time parked."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
            " last_error, actor) VALUES ('quick', %s, '{}', now() - %s::interval, 2, %s, %s)"
            " RETURNING id",
            (command, age, error, actor),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _listed(page: str) -> set[int]:
    """The row ids the parked list shows (each has its retry button)."""
    return {int(n) for n in re.findall(r">retry row (\d+)</button>", page)}


def test_the_parked_list_under_a_selection_shows_only_the_rows_it_counts(
    web: WebApp, database_url: str, schema: str
) -> None:
    relay = _parked(database_url, schema, 3)  # t.web, shop:1, "ConnectionError: <b>down</b>"
    other_error = _parked_as(
        database_url, schema, "t.web", "shop:1", "ValueError: no address", "0s"
    )
    other_command = _parked_as(database_url, schema, "t.other", "shop:1", "ConnectionError", "0s")
    other_actor = _parked_as(database_url, schema, "t.web", "shop:2", "ConnectionError", "0s")
    old = _parked_as(database_url, schema, "t.web", "shop:2", "ConnectionError", "2 hours")
    everything = {*relay, other_error, other_command, other_actor, old}
    _, _, page = call(web, "GET", "/parked", query="family=quick")
    assert _listed(page) == everything  # no selection: the family's parked rows
    for query, matching in (
        ("family=quick&error=down", set(relay)),
        ("family=quick&error=ConnectionError", everything - {other_error}),
        ("family=quick&command=t.other", {other_command}),
        ("family=quick&actor=shop:2", {other_actor, old}),
        ("family=quick&older=60", {old}),
        ("family=quick&command=t.web&actor=shop:1&error=Connection", set(relay)),
        ("family=quick&error=nothing+like+it", set()),
    ):
        _, _, page = call(web, "GET", "/parked", query=query)
        assert f"{len(matching)} parked rows match this selection." in page, query
        assert _listed(page) == matching, query  # the count and the list agree
    # the list stays bounded, and says so when the selection matches more than it shows
    many = set(_parked(database_url, schema, 205))
    _, _, page = call(web, "GET", "/parked", query="error=down")
    assert "208 parked rows match this selection (the first 200 are listed)." in page
    listed = _listed(page)
    assert len(listed) == 200 and listed <= many | set(relay)


def test_the_audit_section_shows_selections_as_json_and_times_to_the_second(
    web: WebApp, dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    _parked(database_url, schema, 2)
    form = {"action": "retry", "family": "quick", "error": "<b>down", "token": web.token()}
    status, _, _ = call(web, "POST", "/bulk", form=form)
    assert status.startswith("303")
    pause = {"family": "quick", "reason": "relay down", "token": web.token()}
    try:
        assert call(web, "POST", "/pause", form=pause)[0].startswith("303")
        _, _, page = call(web, "GET", "/")
        [paused] = dispatcher.ops.paused()
        shown = dispatcher.ops.audit_log(limit=2)  # before the resume below is audited too
    finally:
        dispatcher.ops.resume("quick")
    # the selection: compact JSON, escaped; no Python repr
    assert (
        "<td>{&quot;filter&quot;: {&quot;error&quot;: &quot;&lt;b&gt;down&quot;, "
        "&quot;family&quot;: &quot;quick&quot;}}</td>" in page  # jsonb's key order
    )
    assert "<td>{&quot;family&quot;: &quot;quick&quot;}</td>" in page
    assert "{'filter'" not in page and "{'family'" not in page and "<b>down" not in page
    # the paused family's since and the actions' times: to the second, as the page's other times
    since = paused["paused_at"]
    assert f"<td>{since.isoformat(timespec='seconds')}</td>" in page
    assert str(since) not in page and since.isoformat() not in page
    for entry in shown:
        assert f"<td>{entry['at'].isoformat(timespec='seconds')}</td>" in page
    assert not re.search(r"\d\d:\d\d:\d\d\.\d+", page)  # no fractions of a second anywhere
