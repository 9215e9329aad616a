"""The outbox page's guards and pages as WSGI calls against the real Postgres: no request
without the credentials, no action without the page's token or from another site's form,
and what each page shows (the browser test, tests/acceptance/test_web.py, clicks through)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import psycopg
import pytest

from outbox_dispatch import ConfigurationError, Dispatcher
from outbox_dispatch.ops.web import WebApp, parse_credentials
from tests.conftest import count_rows

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
            " last_error, actor) SELECT 'quick', 't.web', '{\"n\": 1}', now(), 3,"
            " 'ConnectionError: <b>down</b>', 'shop:1' FROM generate_series(1, %s) RETURNING id",
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
    from outbox_dispatch import operations

    status, _, page = call(web, "POST", "/retry", form={"id": "²", "token": web.token()})
    assert status.startswith("200") and "is not a row id" in page
    status, _, _ = call(web, "POST", "/retry", form={"id": "1", "token": "é"})
    assert status.startswith("403")
    status, _, page = call(web, "GET", "/rows", query="q=%C2%B2")
    assert status.startswith("200") and "no row has the id" in page
    with pytest.raises(ConfigurationError):
        WebApp(dispatcher, user="", password="")
    # an empty selection (the admin's rows were deleted meanwhile) cancels nothing
    assert operations.cancel(dispatcher, [], by="test").reasons == ["no row named"]


def test_a_link_cannot_put_words_on_the_page(web: WebApp) -> None:
    _, _, page = call(web, "GET", "/", query="ok=Row+5+was+verified+safe&warn=Purge+all+now")
    assert "verified safe" not in page and "Purge all now" not in page
