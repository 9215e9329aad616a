"""Headless Debian Chromium through Selenium, for the browser test and the docs' screenshots
(scripts/browser installs both)."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


@contextmanager
def chrome() -> Iterator[Any]:
    """A headless Chromium, quit at the end."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.fail("Chromium and chromedriver are missing: scripts/test installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,700",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def save_region(driver: Any, path: Path, parts: Sequence[Any], margin: int = 6) -> None:
    """A PNG of the part of the page that ``parts`` (elements) cover, with a margin: the
    docs' screenshots show what their text describes and stay small. Headings span the
    page's width: the others say how wide the part is."""
    rects = [part.rect for part in parts]
    wide = [p.rect for p in parts if p.tag_name not in ("h1", "h2", "h3")] or rects
    left = max(0, min(r["x"] for r in rects) - margin)
    top = max(0, min(r["y"] for r in rects) - margin)
    right = max(r["x"] + r["width"] for r in wide) + margin
    bottom = max(r["y"] + r["height"] for r in rects) + margin
    clip = {"x": left, "y": top, "width": right - left, "height": bottom - top, "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True}
    )
    path.write_bytes(base64.b64decode(shot["data"]))
