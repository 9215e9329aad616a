"""The NOTIFY wake path: a commit wakes the listener at once; a rollback or a delayed row
does not."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.claim.claimer import ClaimReport
from outbox_dispatch.claim.listener import CommitListener
from tests.conftest import count_rows

pytestmark = pytest.mark.usefixtures("clean")


def test_commit_wakes_the_listener_and_rollback_does_not(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    woken: list[tuple[float, list[str]]] = []
    event = threading.Event()

    def claim(families: list[str] | None) -> ClaimReport:
        if families is not None:  # not the pass over every family when it starts listening
            woken.append((time.monotonic(), families))
            event.set()
        return ClaimReport()

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim)
    listener.start()
    try:
        assert listener.leading.wait(5)
        cmd, job = commands(), commands(family="quick")
        with psycopg.connect(database_url) as conn:
            with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
                dispatcher.enqueue(conn, cmd, {})
                conn.execute("SELECT 1/0")
            with conn.transaction():
                dispatcher.enqueue(conn, cmd, {}, delay=timedelta(minutes=5))
        time.sleep(0.3)
        assert woken == []  # nothing committed that is due now
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                for _ in range(50):
                    dispatcher.enqueue(conn, cmd, {})
                dispatcher.enqueue(conn, job, {})
            committed = time.monotonic()
        assert event.wait(5)
        at, families = woken[0]
        assert sorted(families) == ["intent", "quick"]  # one wake for the whole transaction
        assert at - committed < 0.5
        time.sleep(0.2)
        assert len(woken) == 1
    finally:
        listener.stop()


def test_a_listener_claims_what_was_committed_before_it_listened(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """Workers starting, or a standby taking over: the commits made while nobody listened
    sent notifications no one received. The listener claims every family once when it starts
    listening, so those rows do not wait for beat's pass (no beat runs here)."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, commands(), {})
    passes: list[list[str] | None] = []

    def claim(families: list[str] | None) -> ClaimReport:
        passes.append(families)
        return dispatcher.runtime.claim_and_publish(families)

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim)
    listener.start()
    try:
        assert listener.leading.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # claimed, or already delivered by the worker
            if not count_rows(database_url, schema, f"id = {row_id} AND claim_token IS NULL"):
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"row {row_id} was not claimed when the listener started")
        assert passes[0] is None
    finally:
        listener.stop()


def test_a_leading_listener_claims_rows_that_come_due_without_a_commit(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """A delayed row sends no NOTIFY when it comes due; the leading listener's pass every
    ``sweep`` seconds claims it (beat's entry then only backs the listener up)."""
    passes: list[float] = []

    def claim(families: list[str] | None) -> ClaimReport:
        if families is None:
            passes.append(time.monotonic())
        return dispatcher.runtime.claim_and_publish(families)

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim, sweep=0.2)
    listener.start()
    try:
        assert listener.leading.wait(5)
        with psycopg.connect(database_url) as conn, conn.transaction():
            row_id = dispatcher.enqueue(conn, commands(), {}, delay=timedelta(seconds=0.5))
        deadline = time.monotonic() + 5
        while count_rows(database_url, schema, f"id = {row_id} AND claim_token IS NULL"):
            assert time.monotonic() < deadline, f"row {row_id} came due and was not claimed"
            time.sleep(0.02)
        gaps = [b - a for a, b in itertools.pairwise(passes)]
        assert len(passes) >= 3 and min(gaps) >= 0.15, gaps  # every sweep, not a spin
    finally:
        listener.stop()


def test_only_one_listener_per_schema_leads(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    first = CommitListener(database_url, schema, dispatcher.store.channel, lambda f: ClaimReport())
    second = CommitListener(
        database_url, schema, dispatcher.store.channel, lambda f: ClaimReport(), standby_retry=0.2
    )
    first.start()
    try:
        assert first.leading.wait(5)
        second.start()
        time.sleep(0.5)
        assert not second.leading.is_set()
        first.stop()  # the leader goes away: the standby takes over
        assert second.leading.wait(5)
    finally:
        first.stop()
        second.stop()


def test_a_saturated_family_is_claimed_again_until_its_backlog_is_gone(
    dispatcher: Dispatcher, commands: Callable[..., str], database_url: str, schema: str
) -> None:
    """One commit, and a claim held back by the family's in-flight limit: the listener claims
    that family again every ``refill`` seconds, and stops once a claim is not held back."""
    calls: list[list[str]] = []
    at: list[float] = []
    done = threading.Event()

    def claim(families: list[str] | None) -> ClaimReport:
        if families is None:  # the pass over every family when it starts listening
            return ClaimReport()
        calls.append(families)
        at.append(time.monotonic())
        if len(calls) >= 4:
            done.set()
            return ClaimReport()
        return ClaimReport(saturated={"intent"})

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim, refill=0.05)
    listener.start()
    try:
        assert listener.leading.wait(5)
        with psycopg.connect(database_url) as conn, conn.transaction():
            dispatcher.enqueue(conn, commands(), {})
        assert done.wait(5)
        time.sleep(0.7)  # longer than the idle wait: no notify, nothing saturated, no claim
        assert calls == [["intent"]] * 4
        gaps = [b - a for a, b in itertools.pairwise(at)]
        assert min(gaps) >= 0.045, gaps  # the refill interval, not a spin
    finally:
        listener.stop()


def test_a_family_that_took_freed_slots_is_claimed_again_one_wake_window_later(
    dispatcher: Dispatcher, database_url: str, schema: str
) -> None:
    """A claim that took freed cap slots is followed, with no notification, by another
    ``trail`` seconds later (releases inside the wake window after it woke no one); the
    trailing claims go on while they find freed slots, and one that finds none ends them."""
    at: list[tuple[float, list[str]]] = []
    done = threading.Event()

    def claim(families: list[str] | None) -> ClaimReport:
        at.append((time.monotonic(), families or []))
        if len(at) == 3:
            done.set()
            return ClaimReport()  # found no freed slot: the trail ends
        return ClaimReport(freed={"capped"})

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim, trail=0.2)
    listener.start()
    try:
        assert listener.leading.wait(5)  # its first pass (every family) took freed slots
        assert done.wait(5)
        time.sleep(0.7)  # longer than the idle wait and the trail: no more claims
        assert [families for _, families in at] == [[], ["capped"], ["capped"]]
        gaps = [b - a for (a, _), (b, _) in itertools.pairwise(at)]
        assert min(gaps) >= 0.19, gaps  # one wake window after each claim, not sooner
    finally:
        listener.stop()


def test_failing_claim_passes_back_off_and_a_pass_that_works_resets_them(
    dispatcher: Dispatcher,
    database_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker that stays away fails every claim pass, and each pass claims and gives back a
    batch of rows: the listener waits longer after each failure (here 10, 20, 40 ms, then
    40), and once a pass works the next failure waits the first interval again."""
    monkeypatch.setattr("outbox_dispatch.claim.listener.RETRY_FIRST", 0.01)
    monkeypatch.setattr("outbox_dispatch.claim.listener.RETRY_MOST", 0.04)
    outcomes = iter([False] * 4 + [True, False])  # False: the pass raises
    worked, done = threading.Event(), threading.Event()

    def claim(families: list[str] | None) -> ClaimReport:
        works = next(outcomes, None)
        if works is None:
            done.set()
        elif not works:
            raise ConnectionError("Error 111 connecting to the broker")
        else:
            worked.set()
        return ClaimReport()

    listener = CommitListener(database_url, schema, dispatcher.store.channel, claim)
    with caplog.at_level("ERROR", logger="outbox_dispatch.claim.listener"):
        listener.start()
        try:
            assert worked.wait(10)
            time.sleep(0.1)  # listening again
            dispatcher.store.request_claim("intent")  # a wake: its pass fails
            assert done.wait(10)
        finally:
            listener.stop()
    waits = [
        r.getMessage().rsplit("claiming again in ", 1)[1]
        for r in caplog.records
        if "listener_claim_failed" in r.getMessage()
    ]
    assert waits == ["0.01 s", "0.02 s", "0.04 s", "0.04 s", "0.01 s"], waits
