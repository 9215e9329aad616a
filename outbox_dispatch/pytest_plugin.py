"""A pytest plugin for projects that use outbox_dispatch: deliver what a test enqueued without
running a Celery worker.

Point it at your dispatcher with ``--outbox-app proj.tasks:dispatcher``, the ini option
``outbox_app``, or ``OUTBOX_DISPATCH_APP`` (or override the ``outbox_dispatcher`` fixture).

- ``outbox_drain()``: claim and deliver, in the test's process, everything due now (and what
  those deliveries enqueue), then return the DrainReport.
- ``outbox_inline``: deliver each committed row right after its commit, in a background thread
  of the test process (the same NOTIFY wake a worker uses); ``outbox_inline.wait()`` returns
  once nothing is due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from outbox_dispatch.claim.claimer import ClaimReport
from outbox_dispatch.claim.listener import CommitListener
from outbox_dispatch.dispatcher import Dispatcher
from outbox_dispatch.ops.appload import load_dispatcher
from outbox_dispatch.worker.drain import DrainReport


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outbox_dispatch")
    group.addoption("--outbox-app", help="module:attribute of the Dispatcher under test")
    parser.addini("outbox_app", "module:attribute of the Dispatcher under test", default="")


@pytest.fixture
def outbox_dispatcher(request: pytest.FixtureRequest) -> Dispatcher:
    spec = request.config.getoption("--outbox-app") or request.config.getini("outbox_app")
    dispatcher, _ = load_dispatcher(spec or None)
    return dispatcher


@pytest.fixture
def outbox_drain(outbox_dispatcher: Dispatcher) -> Callable[..., DrainReport]:
    def drain(timeout: float = 10.0) -> DrainReport:
        return outbox_dispatcher.drain(timeout=timeout)

    return drain


class Inline:
    """Deliveries run right after each commit, in a thread of the test process."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.reports: list[DrainReport] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        # one per database: a commit to any of them is delivered (the drain covers them all)
        self.listeners = [
            CommitListener(
                db.url, dispatcher.schema, db.store.channel, self._deliver, standby_retry=0.1
            )
            for db in dispatcher.databases.values()
        ]
        self.listener = self.listeners[0]

    def _deliver(self, families: list[str] | None) -> ClaimReport:
        if families is None:  # the listener starts: rows from before the fixture are not ours
            return ClaimReport()
        with self._lock:
            try:
                self.reports.append(self.dispatcher.drain(timeout=30))
            except BaseException as exc:  # surfaced by wait()
                self.errors.append(exc)
        return ClaimReport()  # a drain leaves nothing due: nothing to top up

    def wait(self, timeout: float = 10.0) -> DrainReport:
        """Return once nothing is due (delivering what still is); raise what a delivery raised."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self.errors:
                    raise self.errors.pop(0)
                report = self.dispatcher.drain(timeout=max(0.1, deadline - time.monotonic()))
            if report.rounds == 0:
                return report
            if time.monotonic() > deadline:
                return report


@pytest.fixture
def outbox_inline(outbox_dispatcher: Dispatcher) -> Iterator[Inline]:
    inline = Inline(outbox_dispatcher)
    for listener in inline.listeners:
        listener.start()
    try:
        if not all(listener.leading.wait(10) for listener in inline.listeners):
            pytest.fail(
                "outbox_inline: another process listens on this schema (a running worker?): "
                "stop it or use outbox_drain"
            )
        yield inline
    finally:
        for listener in inline.listeners:
            listener.stop()
