"""One error tree, so callers can catch ``OutboxError`` and know it came from us.

Each class's docstring is its default message; messages say what the user can do.
"""

from __future__ import annotations

import math
from datetime import timedelta

from outbox_dispatch.core.bounds import MAX_DELAY, real_seconds

_MOST_DELAY = MAX_DELAY.total_seconds()


class OutboxError(Exception):
    """An outbox_dispatch error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(OutboxError):
    """The dispatcher is configured wrongly: check the arguments named in the message."""


class InvalidIdentifier(ConfigurationError):
    """A schema, family or key-prefix name is not a plain identifier (letters, digits, _)."""


class UnknownFamily(OutboxError):
    """No such family: declare it with dispatcher.family(name, ...) first."""


class UnknownCommand(OutboxError):
    """No handler or declaration for this command: register it with @dispatcher.handler."""


class DuplicateRegistration(ConfigurationError):
    """This command is registered twice: each command has exactly one handler."""


class InvalidPayload(OutboxError):
    """The payload cannot be stored: it must be JSON-serializable (dicts, lists, str, numbers)."""


class PayloadTooLarge(InvalidPayload):
    """The payload is over the size limit: store the bulk elsewhere and enqueue a reference."""


class InvalidArgument(OutboxError):
    """An enqueue argument has the wrong type or value: see the message for which one."""


class SchemaNotReady(OutboxError):
    """The outbox schema is missing or behind: run `outbox-dispatch migrate`."""


class DatabaseError(OutboxError):
    """Postgres failed the request: check that it is reachable and the schema is migrated."""


class StatementCancelled(DatabaseError):
    """Postgres cancelled one of our statements: a ``statement_timeout`` or ``lock_timeout``
    of the server, role or URL, or an operator's ``pg_cancel_backend``. The request is tried
    again (the next claim pass, the next claim of a row); if it repeats, raise those settings
    for the outbox's role (``ALTER ROLE ... SET statement_timeout``)."""


class DatabaseUnavailable(DatabaseError):
    """One of the dispatcher's databases is not answering: its rows wait until it is back,
    and the other databases' rows go on. Check that it is up and reachable. ``repeated``: the
    database was already known to be down (the call did not try it), so this says nothing
    new."""

    def __init__(self, message: str, *, repeated: bool = False) -> None:
        super().__init__(message)
        self.repeated = repeated


class NoConnection(DatabaseUnavailable):
    """No connection to the database in time: it is not answering, or it refuses this process
    another session (``max_connections``, the role's connection limit: raise it, or run fewer
    worker processes or a smaller ``pool_size``), or this process's pool is busy."""


class UnknownDatabase(InvalidArgument):
    """A connection or name that is none of the dispatcher's databases: the row would never be
    claimed there. Pass the database to ``Dispatcher(databases=...)``, or use its connection."""


class MaintenanceFailed(OutboxError):
    """A maintenance pass (prune, ordered-head repair, cancel cleanup) failed for some families;
    the others were maintained. The log's maintenance_failed events say which and why."""


class IsolationNotSupported(OutboxError):
    """An ordered family's rows were enqueued or cancelled in a transaction whose snapshot may
    predate another producer's commit (REPEATABLE READ or SERIALIZABLE): use READ COMMITTED."""


class DrainError(OutboxError):
    """drain() could not empty the outbox."""


class DrainTimeout(DrainError):
    """drain() ran out of time with rows still due: raise the timeout or look for slow handlers."""


class DrainLoop(DrainError):
    """Deliveries keep staging new due work: a handler probably enqueues itself without end."""


class PermanentFailure(OutboxError):
    """Raised by a handler to park its row at once: retrying would not help."""


class RetryLater(OutboxError):
    """Raised by a handler to try its row again after ``delay`` seconds (the family's
    max_attempts still applies; then the row is parked)."""

    def __init__(self, delay: float | timedelta, message: str | None = None) -> None:
        seconds = real_seconds(delay)
        if seconds is None or not (math.isfinite(seconds) and seconds <= _MOST_DELAY):
            # refused here, in the handler: it fails as any error does (retried with backoff,
            # its row's last_error says why); found at the settle, it would lose the attempt
            wrong = TypeError if seconds is None else ValueError
            raise wrong(
                "RetryLater delay must be seconds (a number, or a timedelta) up to "
                f"{MAX_DELAY.days} days, got {delay!r}"
            )
        super().__init__(message)
        self.delay = seconds
        self._message = message

    def __reduce__(self) -> tuple[type[RetryLater], tuple[float, str | None]]:
        # rebuilt from its own arguments (pickled by a pool, copied), not from Exception.args
        return (type(self), (self.delay, self._message))


class OutsideTransaction(OutboxError):
    """A task call found no transaction to write its outbox row in: call it inside
    ``transaction.atomic()`` (Django) or ``with outbox_dispatch.using(conn):``."""


class ResultsNotSupported(OutboxError):
    """A task call through the outbox has no result to wait for: the outbox keeps the call,
    not what it returned. Store the outcome where the task can write it (a table, a cache)."""
