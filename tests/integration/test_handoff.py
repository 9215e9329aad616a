"""The local hand-off (handoff.py) against the session's real in-process worker: a claim made in
the worker's process gives its first messages to the worker's idle pool threads without the
broker, the rest through the broker, and what the worker still holds when its consumer stops
goes to the broker for another worker. (A worker's commit listener makes those claims; here
the test makes them in the worker's process, which is what the hand-off looks at.)"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_dispatch import Context, Dispatcher, Message
from outbox_dispatch.handoff import LocalHandoff
from outbox_dispatch.publisher import Wire
from tests.conftest import count_rows
from tests.integration.conftest import in_loop, wait_for


class Rows:
    """A handler that notes the rows it runs (from the worker's pool threads), then sleeps
    ``pause`` seconds or waits for ``release``."""

    def __init__(self, *, pause: float = 0.0, release: threading.Event | None = None) -> None:
        self.ids: list[int] = []
        self.pause, self.release = pause, release
        self._lock = threading.Lock()

    def __call__(self, ctx: Context, payload: Any) -> None:
        with self._lock:
            self.ids.append(ctx.row_id)
        time.sleep(self.pause)
        if self.release is not None:
            assert self.release.wait(10)


def test_a_claimed_row_goes_straight_to_an_idle_pool_process(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    database_url: str,
) -> None:
    h, sent = handoff
    ran = threading.Event()
    cmd = commands(family="quick", fn=lambda ctx, payload: ran.set())
    with psycopg.connect(database_url) as conn, conn.transaction():
        row_id = dispatcher.enqueue(conn, cmd, {})
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
    assert ran.wait(10), "the row was never delivered"
    wait_for(
        lambda: count_rows(database_url, dispatcher.schema, f"id = {row_id}") == 0, "not settled"
    )
    assert h.handed == 1
    assert sent == []  # nothing went through the broker


def test_a_backlog_beyond_the_idle_processes_goes_through_the_broker(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """The worker takes as many messages as it would prefetch (a message per idle pool
    thread); the others go to the broker, where every worker can take them (here the same
    one), and each row runs once."""
    h, sent = handoff
    # long enough that the claim's later messages find no idle thread
    rows = Rows(pause=0.05)
    seen = rows.ids
    cmd = commands(family="quick", fn=rows)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(12)])
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 12}
    wait_for(lambda: len(seen) == 12, "rows were never delivered")
    assert sorted(seen) == sorted(ids)  # each once
    prefetch = int(worker.consumer.qos.value)
    assert 1 <= h.handed <= prefetch
    assert h.handed + sum(sent) >= 2  # both ways were taken (messages, a few rows each)
    assert sum(sent) > 0


def test_what_the_worker_holds_when_its_consumer_stops_goes_to_the_broker(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """A message given to the worker that has not started when its consumer stops (a warm
    shutdown, a lost broker connection) is published for another worker, as kombu gives
    back a prefetched broker message; one that is running is left to finish."""
    h, _sent = handoff
    release, running = threading.Event(), threading.Event()

    def hold(ctx: Context, payload: Any) -> None:
        running.set()
        assert release.wait(10)

    cmd = commands(family="quick", fn=hold)
    with psycopg.connect(database_url) as conn, conn.transaction():
        held = dispatcher.enqueue(conn, cmd, {})
    try:
        dispatcher.claim_and_publish(["quick"])
        assert running.wait(10), "the holding row never started"
        assert h.handed == 1
        queue = dispatcher.queue_name("quick")
        wire = Wire("t-" + uuid.uuid4().hex, "[]", {}, {})
        with h._lock:  # taken, not yet given to Celery
            h._pending.append((queue, wire))
        published: list[tuple[str, list[str]]] = []
        real = h.republish
        h.republish = lambda q, wires: published.append((q, [w.task_id for w in wires]))
        try:
            in_loop(worker, h.detach)  # what the consumer step does when the consumer stops
        finally:
            h.republish = real
        assert published == [(queue, [wire.task_id])]  # not the one that is running
        assert h.take(queue, [wire]) == 0  # detached: the broker from now on
    finally:
        release.set()
    wait_for(lambda: count_rows(database_url, dispatcher.schema, f"id = {held}") == 0, "held")


class _Hooked:
    """The hand-off's lock, with a hook: the ``at``-th time the thread ``ident`` lets it go
    once armed, ``hook`` runs there (another thread's step lands at that point)."""

    def __init__(self, inner: Any, ident: int, at: int = 1) -> None:
        self.inner, self.ident, self.at = inner, ident, at
        self.hook: Callable[[], None] | None = None

    def __enter__(self) -> _Hooked:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)
        hook = self.hook
        if hook is not None and threading.get_ident() == self.ident:
            self.at -= 1
            if self.at == 0:
                self.hook = None
                hook()


def _hook(h: LocalHandoff, ident: int, at: int = 1) -> _Hooked:
    """Put a hooked lock in the hand-off (armed by setting its ``hook``)."""
    hooked = _Hooked(h._lock, ident, at)
    h._lock = hooked  # type: ignore[assignment]
    return hooked


def _loop_thread(worker: Any) -> int:
    """The ident of the worker's event loop thread."""
    ident: list[int] = []
    in_loop(worker, lambda: ident.append(threading.get_ident()))
    return ident[0]


@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_message_taken_while_the_worker_gives_the_last_ones_to_celery_is_given_too(
    at: int,
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """The listener's thread takes a message at any point of the event loop's drain (after
    its first, second or third step). Taken between the drain's reads (of the wake-ups and of
    the messages), it must still be given
    to Celery at once: it once sat in the hand-off until some later take woke the loop,
    which under load never came (a full hand-off takes nothing), so its row waited out its
    lease (60 s by default; 5 s here, longer than the test waits)."""
    h, sent = handoff
    seen: list[int] = []
    cmd = commands(family="quick", fn=lambda ctx, payload: seen.append(ctx.row_id))
    hooked = _hook(h, _loop_thread(worker), at)
    with psycopg.connect(database_url) as conn, conn.transaction():
        first = dispatcher.enqueue(conn, cmd, {"n": 1})

    def second_claim() -> None:  # the listener's thread, while the loop thread drains
        with psycopg.connect(database_url) as conn, conn.transaction():
            ids.append(dispatcher.enqueue(conn, cmd, {"n": 2}))
        claimer = threading.Thread(target=lambda: dispatcher.claim_and_publish(["quick"]))
        claimer.start()
        claimer.join(10)

    ids: list[int] = []
    hooked.hook = second_claim
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
    wait_for(lambda: hooked.hook is None and len(seen) >= 1, "the first row never ran")
    wait_for(lambda: sorted(seen) == sorted([first, *ids]), "the second row waits", timeout=3)
    assert h.handed == 2 and sent == []  # both went through the hand-off


def test_a_take_that_a_consumer_stop_overtakes_leaves_its_message_to_the_broker(
    handoff: tuple[LocalHandoff, list[int]], worker: Any, dispatcher: Dispatcher
) -> None:
    """The listener's thread takes a message, and before it wakes the event loop the consumer
    stops (a warm shutdown): the stop publishes the message and closes the wake-up socket.
    The take must still report the message as taken, so its claim goes on publishing the
    rest; it raised there once, and the claim's later messages were never published (their
    rows waited out their lease)."""
    h, _sent = handoff
    hooked = _hook(h, threading.get_ident())
    published: list[tuple[str, list[str]]] = []
    h.republish = lambda q, wires: published.append((q, [w.task_id for w in wires]))
    queue = dispatcher.queue_name("quick")
    wire = Wire("t-" + uuid.uuid4().hex, "[]", {}, {})
    hooked.hook = lambda: in_loop(worker, h.detach)  # between the take's lock and its wake-up
    assert h.take(queue, [wire]) == 1
    assert hooked.hook is None  # the stop did land in between
    assert published == [(queue, [wire.task_id])]


def test_a_worker_giving_messages_to_celery_is_not_idle(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """Messages the event loop has taken from the hand-off and not yet given to Celery are
    the worker's to run: a take meanwhile counts them, so the listener does not hand rows to
    a pool process as if it were idle (the row would wait behind them)."""
    h, _sent = handoff
    cmd = commands(family="quick")
    hooked = _hook(h, _loop_thread(worker), at=2)  # after the loop takes the messages
    queue = dispatcher.queue_name("quick")
    processes = int(worker.consumer.pool.num_processes)
    idle_take: list[int] = []

    def take_as_idle() -> None:  # the listener's thread, a row named for each process
        wires = [Wire("t-" + uuid.uuid4().hex, "[]", {}, {}) for _ in range(processes)]
        taker = threading.Thread(target=lambda: idle_take.append(h.take(queue, wires, idle=True)))
        taker.start()
        taker.join(10)

    hooked.hook = take_as_idle
    with psycopg.connect(database_url) as conn, conn.transaction():
        row = dispatcher.enqueue(conn, cmd, {})
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
    wait_for(lambda: idle_take != [], "the loop never took the message")
    assert idle_take == [processes - 1]
    wait_for(lambda: count_rows(database_url, dispatcher.schema, f"id = {row}") == 0, "not run")


def test_a_running_message_given_back_after_the_consumer_stopped_goes_to_the_broker(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """A batched message (acknowledged when it ends) is running when the consumer stops; then
    its pool process dies and Celery gives it back for requeue. Its rows not yet run must go
    to the broker then, as they would have before the stop, not wait out their lease."""
    h, _sent = handoff
    release = threading.Event()
    rows = Rows(release=release)
    started = rows.ids
    cmd = commands(family="quick", fn=rows)
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(12)])
    try:
        dispatcher.claim_and_publish(["quick"])
        wait_for(lambda: len(started) >= 1 and h._outstanding != {}, "no batch is running")
        with h._lock:
            tag = next(iter(h._outstanding))
        published: list[tuple[str, list[str]]] = []
        h.republish = lambda q, wires: published.append((q, [w.task_id for w in wires]))
        in_loop(worker, h.detach)
        running = [t for _q, tags in published for t in tags]
        assert tag not in running  # running: left to finish
        h.rejected(tag, True)  # what Celery does when the pool process running it dies
        assert [t for _q, tags in published for t in tags] == [*running, tag]
    finally:
        release.set()


def test_messages_a_stopping_consumer_cannot_publish_run_when_it_starts_again(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """A consumer stops because its broker connection dropped, with a claimed message taken
    and not yet given to Celery: the stop's publish fails as well. The message must run when
    the consumer starts again (the broker is back), not wait out its row's lease."""
    h, sent = handoff
    ran = threading.Event()
    cmd = commands(family="quick", fn=lambda ctx, payload: ran.set())
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue(conn, cmd, {})

    def broker_away(queue: str, wires: Any) -> None:
        raise ConnectionError("Error 111 connecting to the broker")

    hooked = _hook(h, threading.get_ident())
    republish, h.republish = h.republish, broker_away
    hooked.hook = lambda: in_loop(worker, h.detach)  # between the take and its wake-up
    assert dispatcher.claim_and_publish(["quick"]).claimed == {"quick": 1}
    assert hooked.hook is None
    assert not ran.wait(0.3)  # the consumer is stopped
    h.republish = republish
    in_loop(worker, lambda: h.attach(worker.consumer))  # the broker is back
    assert ran.wait(3), "the kept message did not run when the consumer started again"
    assert h.handed == 1 and sent == []


def _measured(dispatcher: Dispatcher, commands: Callable[..., str], database_url: str) -> None:
    """One row of family "single" delivered, and its run time read back by the claimer: the
    local feed sizes itself from it (policy.local_feed)."""
    cmd = commands(family="single", fn=lambda ctx, payload: time.sleep(0.01))
    with psycopg.connect(database_url) as conn, conn.transaction():
        dispatcher.enqueue(conn, cmd, {})
    dispatcher.drain(timeout=10)
    wait_for(
        lambda: dispatcher.claimer.feed_basis(dispatcher.families["single"]) is not None,
        "the family's run time was never read",
        timeout=5,
    )


def test_a_claim_of_one_row_messages_feeds_the_worker_its_share_past_its_prefetch(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """A family pinned to one row per message skips the broker for three quarters of a
    claim when this worker is its only consumer (each broker message costs the worker's
    main thread a fetch and two round trips to Redis); the last quarter goes through the
    broker, where a worker that joins finds it. Each row runs once."""
    _measured(dispatcher, commands, database_url)
    h, sent = handoff
    rows = Rows(pause=0.01)
    seen = rows.ids
    cmd = commands(family="single", fn=rows)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(40)])
    before = _handed_off("single")
    assert dispatcher.claim_and_publish(["single"]).claimed == {"single": 40}
    wait_for(lambda: len(seen) == 40, "rows were never delivered")
    assert sorted(seen) == sorted(ids)  # each once
    assert int(worker.consumer.qos.value) < h.handed == 30
    assert sum(sent) == 10
    assert _handed_off("single") - before == 30  # what operators see of it


def _handed_off(family: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        "outbox_handed_off_total", {"database": "default", "family": family}
    )
    return value or 0.0


def test_a_fed_worker_whose_consumer_stops_gives_what_waits_to_the_broker(
    dispatcher: Dispatcher,
    commands: Callable[..., str],
    handoff: tuple[LocalHandoff, list[int]],
    worker: Any,
    database_url: str,
) -> None:
    """A warm shutdown with a fed backlog: what has not started goes to the broker (here the
    same worker takes it from there), what runs finishes, and each row runs once."""
    _measured(dispatcher, commands, database_url)
    h, sent = handoff
    release = threading.Event()
    rows = Rows(release=release)
    seen = rows.ids
    cmd = commands(family="single", fn=rows)
    with psycopg.connect(database_url) as conn, conn.transaction():
        ids = dispatcher.enqueue_many(conn, [Message(cmd, {"n": i}) for i in range(40)])
    try:
        assert dispatcher.claim_and_publish(["single"]).claimed == {"single": 40}
        assert h.handed == 30
        wait_for(lambda: len(seen) == 4, "the pool threads never took the first rows")
        in_loop(worker, h.detach)  # what the consumer step does when the consumer stops
        assert sum(sent) > 10  # the broker's quarter, and the fed rows that had not started
    finally:
        release.set()
    wait_for(lambda: len(seen) == 40, "rows were never delivered")
    assert sorted(seen) == sorted(ids)  # each once
    wait_for(lambda: count_rows(database_url, dispatcher.schema) == 0, "rows not settled")
