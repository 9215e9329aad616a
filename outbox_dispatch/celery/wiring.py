"""Celery wiring in one place: tasks, queues, the claimer's beat entry, safe serialization.

Settings are written without being read first, because reading ``app.conf`` finalizes the
configuration before the user has loaded theirs; what must be merged with user settings
(queues) is done when Celery finishes configuring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from celery.exceptions import Ignore
from kombu.entity import Queue

from outbox_dispatch.celery.task_states import Report, TaskState, task_state
from outbox_dispatch.core import timings
from outbox_dispatch.worker.leaving import Leaving, message_rows
from outbox_dispatch.worker.messages import GoesBack, Result

if TYPE_CHECKING:
    from outbox_dispatch.claim.listener import CommitListener
    from outbox_dispatch.dispatcher import Dispatcher
    from outbox_dispatch.worker.slots import CapSlots

DELIVER_TASK = "outbox.deliver"  # every delivery message: one row, or a batch of them
DELIVER_ROW_TASK = "outbox.deliver_row"  # still run: messages queued under this name
DELIVER_TASKS = frozenset({DELIVER_TASK, DELIVER_ROW_TASK})
CLAIM_TASK = "outbox.claim"
CLAIM_ENTRY = "outbox-dispatch claimer"
PRUNE_TASK = "outbox.prune"
CRON_TASK = "outbox.cron"
QUIET_TASKS = frozenset({CLAIM_TASK, PRUNE_TASK, CRON_TASK})  # no events, no INFO lines
# The maintenance tasks' options: Celery's own task class (also under task_cls=OutboxTask),
# not shared with other apps, fire and forget, and no task events (Flower stays quiet).
MAINTENANCE: dict[str, Any] = {
    "base": Task,
    "shared": False,
    "ignore_result": True,
    "acks_late": False,
    "send_events": False,
}


def write_settings(app: Celery) -> None:
    conf = app.conf
    # JSON only: nothing is ever unpickled, by our tasks or anyone else's on this app.
    conf["task_serializer"] = "json"
    conf["result_serializer"] = "json"
    conf["accept_content"] = ["json"]
    conf["result_accept_content"] = ["json"]
    conf["event_serializer"] = "json"
    on_configured(app, lambda: _soft_defaults(app))


# Our defaults where the user kept Celery's: one message reserved per pool process (a prefetched
# message waits while its lease runs), and no startup-retry deprecation warning.
SOFT_DEFAULTS = {"worker_prefetch_multiplier": 1, "broker_connection_retry_on_startup": True}


def _soft_defaults(app: Celery) -> None:
    from celery.app.defaults import DEFAULTS

    for key, value in SOFT_DEFAULTS.items():
        if app.conf.get(key) == DEFAULTS.get(key):
            app.conf[key] = value


def register_tasks(
    app: Celery,
    deliver: Callable[[tuple[Any, ...], str | None, float | None, bool], Sequence[Result]],
    claim: Callable[[list[str] | None, str | None], object],
) -> tuple[Any, Any]:
    """The delivery tasks take raw args so a garbage message reaches our check, not a
    TypeError; they report their rows' outcome as their Celery state (task_states.py). The
    claim task sends no task events: one a second from beat would drown the deliveries in
    Flower.

    A delivery message is acknowledged once it ends and given back to the broker when its pool
    process dies (acks_late, reject_on_worker_lost): the rows after the one that was running
    then run at once, not after their lease (the row that was running is refused at its second
    start, and its lease decides). ``outbox.deliver_row`` stays registered so that one-row
    messages already queued under that name run during a rolling deploy.

    A first delivery whose rows could not start for want of a database connection (this
    process's pool used up, or Postgres refusing it sessions) goes back to its queue as a
    Celery retry (Flower shows RETRY), with the rows not started, for a process that has one:
    it does not wait in this one, nor for its rows' lease."""
    common: dict[str, Any] = {
        "base": Task,  # Celery's own, also in an app whose task_cls is OutboxTask
        "shared": False,  # a shared task would be added to every other Celery app in the process
        "bind": True,
        "ignore_result": True,
        "typing": False,
    }

    def run(self: Any, *args: Any, **kwargs: Any) -> str:
        stop_at = soft_limit_at(self, time.monotonic())
        info = getattr(self.request, "delivery_info", None) or {}
        # Celery reads False where the broker does not mark redeliveries (Redis and RabbitMQ do)
        first = info.get("redelivered", True) is False
        try:
            results = deliver(args, info.get("routing_key"), stop_at, first)
        except GoesBack as back:
            database, _ = message_rows(args)
            raise self.retry(args=back.message(database), countdown=0, exc=back.cause) from None
        return report(self, task_state(results))

    # max_retries None: a message goes back (GoesBack) as often as it meets no connection
    acks: dict[str, Any] = {"acks_late": True, "reject_on_worker_lost": True, "max_retries": None}
    deliver_task = app.task(name=DELIVER_TASK, **acks, **common)(run)
    app.task(name=DELIVER_ROW_TASK, **acks, **common)(run)

    @app.task(name=CLAIM_TASK, **MAINTENANCE)  # type: ignore[untyped-decorator]
    def claim_task(families: Any = None, database: Any = None) -> None:
        # a wake names the family whose slot freed (and its database, unless the first); beat
        # passes nothing: every family of every database
        names = [f for f in families if isinstance(f, str)] if isinstance(families, list) else None
        claim(names, database if isinstance(database, str) else None)

    quiet_celery_logs()
    hand_back_when_stopping(app)
    return deliver_task, claim_task


def hand_back_when_stopping(app: Celery) -> None:
    """A worker that is stopped hands back the rows of the delivery messages it holds
    (worker/leaving.py): those not started when a warm shutdown begins (SIGTERM), and those
    cut off when a cold one ends (the soft shutdown's timeout, SIGQUIT). Celery's signals, in
    the worker's main process."""
    from celery import signals

    def slots_of(database: str | None) -> CapSlots | None:
        dispatcher: Dispatcher | None = getattr(app, "outbox_dispatcher", None)
        if dispatcher is None:
            return None
        db = dispatcher.databases.get(database) if database else dispatcher.database()
        return None if db is None else db.delivery.slots

    leaving = Leaving(slots_of)

    def received(sender: Any, request: Any, **_kw: Any) -> None:
        task = request.task  # its name, not the request's: Flower's name for the delivery
        if task.name in DELIVER_TASKS and getattr(task, "app", None) is app:
            leaving.received(request, sender)

    def shutting_down(how: str = "Warm", **_kw: Any) -> None:
        leaving.stopping(cold=how == "Cold")

    def shutdown(**_kw: Any) -> None:
        leaving.stopped()

    signals.task_received.connect(received, weak=False)
    signals.worker_shutting_down.connect(shutting_down, weak=False)
    signals.worker_shutdown.connect(shutdown, weak=False)


def soft_limit_at(task: Any, accepted: float) -> float | None:
    """When the soft time limit the message carries (its family's, times its rows) fires, by
    the clock Celery times it with: from the moment the pool process took the message, which
    ``accepted`` (the task's first line) follows closely."""
    limits = getattr(task.request, "timelimit", None)
    soft = limits[1] if isinstance(limits, list | tuple) and len(limits) == 2 else None
    if isinstance(soft, bool) or not isinstance(soft, int | float) or soft <= 0:
        return None
    return accepted + soft - timings.SOFT_LIMIT_MARGIN


def report(task: Any, state: TaskState) -> str:
    """Hand Celery the state: a result (SUCCESS), or an event of ours and Ignore, which acks
    the message and sends nothing more. The event of a retried or parked row carries the
    handler's error and traceback, so Flower shows where the handler failed (a Retry or an
    exception raised here would show this module's frames); the row's own log line says it
    once, so Celery logs no traceback of its own."""
    if state.report is Report.SUCCESS:
        return state.text
    fields: dict[str, Any]
    if state.report in (Report.RETRY, Report.FAILURE):
        name = "task-retried" if state.report is Report.RETRY else "task-failed"
        fields = {"exception": state.text, "traceback": state.traceback}
    else:
        name = "task-revoked" if state.report is Report.REVOKED else "task-stale"
        fields = {"reason": state.text, "terminated": False, "expired": False}
    # sent whether or not this worker sends task events: Flower switches them on by remote
    # control, which a pool process cannot see; nobody listening, it is dropped
    try:
        task.send_event(name, **fields)
    except Exception as exc:  # the row is settled; only Flower's view is missing
        logging.getLogger(__name__).warning("could not send %s: %r", name, exc)
    raise Ignore(state.text)


class _QuietMaintenance(logging.Filter):
    """Drops Celery's INFO lines about the maintenance tasks (beat sending them, a worker
    receiving, finishing or discarding them); their own lines say when they did something."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        args = record.args
        values = (
            args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else ()
        )
        return not any(isinstance(v, str) and v in QUIET_TASKS for v in values)


_QUIET = _QuietMaintenance()


def quiet_celery_logs() -> None:
    for logger in (
        "celery.beat",
        "celery.worker.strategy",
        "celery.app.trace",
        "celery.worker.request",
    ):
        log = logging.getLogger(logger)
        if _QUIET not in log.filters:
            log.addFilter(_QUIET)


def register_periodic(app: Celery, name: str, fn: Callable[[], object]) -> Any:
    """A maintenance task (prune, cron) that beat schedules on the claim queue."""

    @app.task(name=name, **MAINTENANCE)  # type: ignore[untyped-decorator]
    def periodic() -> None:
        fn()

    return periodic


def add_periodic_entry(app: Celery, entry: str, task: str, interval: float, queue: str) -> None:
    app.add_periodic_task(
        interval, app.signature(task), name=entry, expires=max(interval, 0.5), queue=queue
    )


def add_beat_entry(app: Celery, interval: float, claim_queue: str) -> None:
    # expires: a claim that could not start within one interval is superseded by the next one,
    # so a stalled worker does not find a pile of claim messages when it comes back.
    app.add_periodic_task(
        interval,
        app.signature(CLAIM_TASK),
        name=CLAIM_ENTRY,
        expires=max(interval, 0.5),
        queue=claim_queue,
    )


def apply_queues(app: Celery, names: Iterable[str]) -> None:
    """Merge our queues into ``task_queues`` (keeping the default queue and the user's)."""
    conf = app.conf
    existing = list(conf.task_queues or [])
    if not existing:
        default = conf.task_default_queue or "celery"
        existing = [Queue(default, routing_key=default)]
    have = {q.name for q in existing}
    added = [Queue(n, routing_key=n) for n in names if n not in have]
    conf.task_queues = [*existing, *added]
    amqp = app.__dict__.get("amqp")
    # Once the worker built its queue table, new families must be added there too.
    if amqp is not None and "queues" in amqp.__dict__:
        for q in added:
            amqp.queues.add(q)


def on_configured(app: Celery, fn: Callable[[], None]) -> None:
    """Run ``fn`` now if Celery is configured, else right after it finishes configuring."""
    if app.configured:
        fn()
        return

    def handler(sender: Celery, **_kw: Any) -> None:
        if sender is app:
            fn()

    app.on_after_configure.connect(handler, weak=False)


def on_pool_process_start(fn: Callable[[], None]) -> None:
    """Run ``fn`` in each pool process as it starts (prefork children, and the ones that
    replace them)."""
    from celery import signals

    _on_signals(fn, signals.worker_process_init)


def on_worker_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when a pool process or the worker shuts down (a warm shutdown), so work
    handed to background threads is finished, not dropped."""
    from celery import signals

    _on_signals(fn, signals.worker_process_shutdown, signals.worker_shutdown)


def _on_signals(fn: Callable[[], None], *sent: Any) -> None:
    def handler(**_kw: Any) -> None:
        fn()

    for signal in sent:
        signal.connect(handler, weak=False)


def install_listener_step(app: Any, make: Callable[[], list[CommitListener]]) -> None:
    """Run the commit listeners (one per database) in a process each worker forks once its
    pool has started (claim/listener.py's ListenerProcess), apart from the process that
    consumes."""
    from celery import bootsteps

    from outbox_dispatch.claim.listener import ListenerProcess

    class OutboxCommitListener(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = ("celery.worker.components:Pool",)

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.process: ListenerProcess | None = None

        def start(self, parent: Any) -> None:
            self.process = ListenerProcess(make)
            self.process.start()

        def stop(self, parent: Any) -> None:
            if self.process is not None:
                self.process.stop()

    app.steps["worker"].add(OutboxCommitListener)
