"""The outbox page end to end in headless Chromium (Debian's, driven by Selenium), against the
real Postgres and a real worker: it refuses to start without credentials; with them, an
operator loads the status page, finds a parked row, retries it, and sees it delivered; then
finds a scheduled row by its dedupe key and cancels it. A second operator reads where a
handler failed three calls deep, pauses a family, retries every parked row a selection
matches (after the count, and again when the count changed), resumes it, and reads the audit
section. With OUTBOX_SCREENSHOTS set (scripts/screenshots), the docs' screenshots of the page
are saved there."""

from __future__ import annotations

import base64
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.chaos.services import free_port
from tests.conftest import count_rows
from tests.fixtures.processes import cli, worker_with_beat
from tests.support.browser import save_region

RELAY_DOWN = "ConnectionError: the mail relay was down"


def _wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_an_operator_retries_a_parked_row_and_cancels_one_in_a_real_browser(
    clean_acc: dict[str, str],
    spawn: Callable[..., Any],
    browser: Any,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    env = {**clean_acc, "OUTBOX_DISPATCH_APP": "tests.apps.web_app:dispatcher"}
    env.pop("OUTBOX_WEB_AUTH", None)
    refused = cli(env, "web", "--port", str(free_port()))
    assert refused.returncode == 2 and "never runs open" in refused.stderr
    port = free_port()
    spawn(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", "web", "--port", str(port)],
        {**env, "OUTBOX_WEB_AUTH": "ops:s3cret"},
        "web",
    )
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        parked_row = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
            " last_error, actor) VALUES ('kept', 'web.notify', '{\"order\": 7}', now(), 3,"
            " 'ConnectionError: the mail relay was down', 'shop:7') RETURNING id"
        ).fetchone()
        later_row = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, due_at, dedupe_key)'
            " VALUES ('kept', 'web.notify', '{}', now() + interval '1 hour', 'reminder:9')"
            " RETURNING id"
        ).fetchone()
    assert parked_row is not None and later_row is not None
    parked, later = parked_row[0], later_row[0]

    # basic auth through a header (Chrome takes no credentials in URLs of a page's requests)
    browser.execute_cdp_cmd("Network.enable", {})
    token = base64.b64encode(b"ops:s3cret").decode()
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
    )
    base = f"http://127.0.0.1:{port}"
    _wait_for(lambda: _loads(browser, base + "/"))
    assert "kept" in browser.find_element(By.TAG_NAME, "table").text
    shots = os.environ.get("OUTBOX_SCREENSHOTS")  # scripts/screenshots keeps them for the docs

    browser.find_element(By.LINK_TEXT, "parked").click()
    _wait_for(lambda: "the mail relay was down" in browser.page_source)
    if shots:
        browser.save_screenshot(str(Path(shots) / "outbox-page.png"))
    browser.find_element(By.XPATH, f"//button[text()='retry row {parked}']").click()
    _wait_for(lambda: "1 row due again (attempts reset)" in browser.page_source)
    assert f"row {parked}: due" in browser.page_source

    worker = spawn(worker_with_beat("tests.apps.web_app", tmp_path, concurrency=1), env, "worker")

    def delivered() -> bool:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        browser.refresh()
        return f"row {parked}: delivered" in browser.page_source

    _wait_for(delivered, timeout=60)
    if shots:
        browser.save_screenshot(str(Path(shots) / "outbox-row.png"))
    assert (
        "delivered"
        in browser.find_element(By.XPATH, "//h3[text()='history']/following::table[1]").text
    )

    search = browser.find_element(By.NAME, "q")
    search.clear()
    search.send_keys("reminder:9")
    search.submit()
    _wait_for(lambda: f"row {later}: scheduled" in browser.page_source)
    browser.find_element(By.XPATH, f"//button[text()='cancel row {later}']").click()
    _wait_for(lambda: "1 row cancelled" in browser.page_source)
    assert "cancelled by outbox page: ops" in browser.page_source


def _loads(browser: Any, url: str) -> bool:
    try:
        browser.get(url)
    except Exception:  # the server is not up yet
        return False
    return "outbox: status" in browser.title


@pytest.fixture
def no_pause_left(clean_acc: dict[str, str]) -> Iterator[None]:
    """Whatever this test pauses is resumed at its end, passed or failed: the other tests of
    the schema run their families."""
    yield
    schema = clean_acc["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(clean_acc["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox_paused')


def test_an_operator_reads_a_traceback_pauses_acts_on_a_selection_and_reads_the_audit(
    clean_acc: dict[str, str],
    spawn: Callable[..., Any],
    browser: Any,
    tmp_path: Path,
    no_pause_left: None,
) -> None:
    """With a real worker: a handler that fails three calls deep is parked and its row shows
    the traceback down to the failing function; the operator pauses the family whose relay is
    down, selects its parked rows by error text (the page shows how many match and acts only
    when the button naming that count is pressed), retries them all while paused (they wait),
    resumes (they are delivered), and finds the three actions in the audit section."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    env = {**clean_acc, "OUTBOX_DISPATCH_APP": "tests.apps.web_app:dispatcher"}
    schema, url = env["OUTBOX_TEST_SCHEMA"], env["OUTBOX_TEST_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:  # this test's actions only
        conn.execute(f'TRUNCATE "{schema}".outbox_paused, "{schema}".outbox_audit')
        invoice = _one(
            conn,
            f'INSERT INTO "{schema}".outbox (family, command, payload, actor) VALUES'
            """ ('billing', 'web.invoice', '{"country": "XK", "lines": [{"net": 40}]}',"""
            " 'order:31') RETURNING id",
        )
        relay = [_parked(conn, schema, RELAY_DOWN, f"shop:{n}") for n in range(1, 5)]
        other = _parked(conn, schema, "ValueError: no address for shop:9", "shop:9")
    port = free_port()
    spawn(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", "web", "--port", str(port)],
        {**env, "OUTBOX_WEB_AUTH": "ops:s3cret"},
        "web",
    )
    worker = spawn(worker_with_beat("tests.apps.web_app", tmp_path, concurrency=1), env, "worker")
    base = _signed_in(browser, port)
    shots = os.environ.get("OUTBOX_SCREENSHOTS")

    # the handler's traceback, down to the function three calls deep that raised
    def parked() -> bool:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        browser.get(f"{base}/rows?q={invoice}")
        return f"row {invoice}: parked" in browser.page_source

    _wait_for(parked, timeout=60)
    trace = browser.find_element(By.XPATH, "//h3[text()='traceback']/following::pre[1]")
    for frame in ("in invoice", "in _invoice_total", "in _line_price", "in _vat_rate_for"):
        assert frame in trace.text
    assert "return VAT_RATES[country]" in trace.text and "KeyError: 'XK'" in trace.text
    if shots:
        error = browser.find_element(By.XPATH, "//h3[text()='last error']")
        save_region(browser, Path(shots) / "outbox-traceback.png", [error, trace])

    # pause the family while its relay is down
    browser.get(base + "/")
    pause = "//form[@action='/pause']"
    Select(browser.find_element(By.XPATH, f"{pause}//select")).select_by_visible_text("kept")
    browser.find_element(By.XPATH, f"{pause}//input[@name='reason']").send_keys("relay down")
    browser.find_element(By.XPATH, f"{pause}//button").click()
    _wait_for(lambda: "family kept paused" in browser.page_source)
    paused = browser.find_element(By.XPATH, "//h3[text()='paused families']/following::table[1]")
    assert "kept" in paused.text and "relay down" in paused.text
    assert "outbox page: ops" in paused.text
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 relay down", paused.text)
    assert "PAUSED" in browser.find_element(By.XPATH, "//table[1]").text

    # select the parked rows by error text: the count first, nothing done until confirmed
    browser.find_element(By.LINK_TEXT, "parked").click()
    selection = "//form[@action='/parked']"
    _wait_for(lambda: bool(browser.find_elements(By.XPATH, selection)))
    browser.find_element(By.XPATH, f"{selection}//input[@name='error']").send_keys("mail relay")
    browser.find_element(By.XPATH, f"{selection}//button[text()='select']").click()
    _wait_for(lambda: "4 parked rows match this selection" in browser.page_source)
    assert count_rows(url, schema, "family = 'kept' AND parked_at IS NOT NULL") == 5
    listed = browser.find_element(By.XPATH, "//table[1]").text  # the 4 it counts, no other
    assert all(f"retry row {r}" in listed for r in relay) and f"row {other}" not in listed
    assert "no address" not in listed
    confirm = browser.find_element(By.XPATH, "//button[text()='retry all 4 matching rows']")
    assert browser.find_element(By.XPATH, "//button[text()='purge all 4 matching rows']")
    if shots:
        matched = browser.find_element(By.XPATH, "//p[contains(@class, 'msg')]")
        listed = browser.find_element(By.XPATH, "//table[1]")
        form = browser.find_element(By.XPATH, selection)
        save_region(browser, Path(shots) / "outbox-bulk.png", [form, matched, listed])
    # one more row matches before the click: the 4 confirmed no longer hold, nothing is done
    with psycopg.connect(url, autocommit=True) as conn:
        relay.append(_parked(conn, schema, RELAY_DOWN, "shop:5"))
    confirm.click()
    _wait_for(lambda: "5 parked rows match this selection" in browser.page_source)
    assert "not the 4 you confirmed" in browser.page_source
    assert count_rows(url, schema, "family = 'kept' AND parked_at IS NOT NULL") == 6
    browser.find_element(By.XPATH, "//button[text()='retry all 5 matching rows']").click()
    _wait_for(lambda: "5 rows due again (attempts reset)" in browser.page_source)
    ids = ", ".join(map(str, relay))
    assert count_rows(url, schema, f"id IN ({ids}) AND parked_at IS NULL") == 5
    assert count_rows(url, schema, f"id = {other} AND parked_at IS NOT NULL") == 1
    # the family is paused: the retried rows wait, unclaimed, until it is resumed
    assert count_rows(url, schema, f"id IN ({ids}) AND claim_token IS NULL") == 5

    browser.find_element(By.LINK_TEXT, "status").click()
    _wait_for(lambda: bool(browser.find_elements(By.XPATH, "//button[text()='resume kept']")))
    resume = browser.find_element(By.XPATH, "//button[text()='resume kept']")
    if shots:  # the family's rows due, waiting for its resume
        status = browser.find_element(By.XPATH, "//table[1]")
        paused = browser.find_element(
            By.XPATH, "//h3[text()='paused families']/following::table[1]"
        )
        save_region(browser, Path(shots) / "outbox-pause.png", [status, paused, resume])
    resume.click()
    _wait_for(lambda: "family kept resumed" in browser.page_source)

    def delivered() -> bool:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        return count_rows(url, schema, f"id IN ({ids}) AND done_at IS NOT NULL") == 5

    _wait_for(delivered, timeout=60)

    # the audit section lists the three actions, newest first, with who, what and why
    browser.refresh()
    audit = browser.find_element(
        By.XPATH, "//h3[text()='recent operator actions']/following::table[1]"
    )
    lines = audit.find_elements(By.TAG_NAME, "tr")[1:]
    assert [line.find_elements(By.TAG_NAME, "td")[2].text for line in lines] == [
        "resume",
        "retry",
        "pause",
    ]
    assert all("outbox page: ops" in line.text for line in lines)
    assert "mail relay" in lines[1].text and "relay down" in lines[2].text
    selections = [line.find_elements(By.TAG_NAME, "td")[4].text for line in lines]
    assert selections[1] == '{"filter": {"error": "mail relay"}}'  # JSON, not a Python repr
    assert selections[0] == selections[2] == '{"family": "kept"}'
    assert not any(re.search(r":\d\d\.\d", line.text) for line in lines)  # to the second
    assert lines[1].find_elements(By.TAG_NAME, "td")[3].text == "5"
    if shots:
        title = browser.find_element(By.XPATH, "//h3[text()='recent operator actions']")
        save_region(browser, Path(shots) / "outbox-audit.png", [title, audit])


def _one(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...] = ()) -> int:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def _parked(conn: psycopg.Connection[Any], schema: str, error: str, actor: str) -> int:
    """A parked row of the ``kept`` family, failed three times with ``error``."""
    return _one(
        conn,
        f'INSERT INTO "{schema}".outbox (family, command, payload, parked_at, attempts,'
        " last_error, actor) VALUES ('kept', 'web.notify', '{}', now(), 3, %s, %s) RETURNING id",
        (error, actor),
    )


def _signed_in(browser: Any, port: int) -> str:
    """The page's address, once it answers, with the operator's credentials sent on every
    request (Chrome takes no credentials in URLs of a page's requests)."""
    browser.execute_cdp_cmd("Network.enable", {})
    token = base64.b64encode(b"ops:s3cret").decode()
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
    )
    base = f"http://127.0.0.1:{port}"
    _wait_for(lambda: _loads(browser, base + "/"))
    return base
