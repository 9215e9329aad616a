"""The outbox page end to end in headless Chromium (Debian's, driven by Selenium), against the
real Postgres and a real worker: it refuses to start without credentials; with them, an
operator loads the status page, finds a parked row, retries it, and sees it delivered; then
finds a scheduled row by its dedupe key and cancels it."""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from tests.chaos.services import free_port
from tests.fixtures.processes import cli, worker_with_beat


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
