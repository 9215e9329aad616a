"""A screenshot of Flower while the demo runs (``python -m tests.support.flower_demo
PATH``, from scripts/screenshots): Flower on the demo's app, the demo with task events on,
and Flower's task list taken once deliveries of every outcome are listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium.webdriver.common.by import By

from tests.chaos.services import free_port
from tests.support.browser import chrome

WANT = {"SUCCESS", "RETRY", "FAILURE"}


def main(path: str) -> int:
    port = free_port()
    env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true", "PYTHONUNBUFFERED": "1"}
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "outbox_dispatch.demo.app",
            "flower",
            "--address=127.0.0.1",
            f"--port={port}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    demo = subprocess.Popen(
        [sys.executable, "-m", "outbox_dispatch.ops.cli", "demo", "--events", "--rows", "3000"],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and demo.poll() is None:
            states = _states(port)
            if WANT.issubset(states):
                break
            time.sleep(0.5)
        with chrome() as browser:
            browser.set_window_size(1400, 1150)
            browser.get(f"http://127.0.0.1:{port}/tasks")
            while len(browser.find_elements(By.CSS_SELECTOR, "#tasks-table tbody tr")) < 10:
                assert time.monotonic() < deadline, "Flower's task table did not fill"
                time.sleep(0.2)
            time.sleep(0.5)
            browser.save_screenshot(path)
        print(f"flower_demo: {path} taken; states seen: {sorted(_states(port))}")
        return demo.wait(timeout=300)
    finally:
        for p in (demo, flower):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


def _states(port: int) -> set[str]:
    try:
        url = f"http://127.0.0.1:{port}/api/tasks?limit=2000"
        with urllib.request.urlopen(url, timeout=5) as r:
            tasks = json.load(r)
    except OSError:
        return set()
    return {str(t.get("state")) for t in tasks.values()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(Path("docs/flower-demo.png"))))
