"""outbox_dispatch: a transactional outbox that delivers through Celery.

Write a row with ``Dispatcher.enqueue`` in the same transaction as your business change; the
claimer moves due rows into Celery queues per family and workers deliver and settle them.
"""

from outbox_dispatch.celery.tasks import EnqueuedTask, OutboxTask
from outbox_dispatch.celery.transactions import using
from outbox_dispatch.core.errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailable,
    DrainError,
    DrainLoop,
    DrainTimeout,
    DuplicateRegistration,
    InvalidArgument,
    InvalidIdentifier,
    InvalidPayload,
    IsolationNotSupported,
    MaintenanceFailed,
    OutboxError,
    OutsideTransaction,
    PayloadTooLarge,
    PermanentFailure,
    ResultsNotSupported,
    RetryLater,
    SchemaNotReady,
    StatementCancelled,
    UnknownCommand,
    UnknownDatabase,
    UnknownFamily,
)
from outbox_dispatch.core.handlers import Context
from outbox_dispatch.core.policy import Backoff, Family, LostAttempt
from outbox_dispatch.core.settle import Outcome
from outbox_dispatch.core.validation import Message
from outbox_dispatch.dispatcher import Dispatcher
from outbox_dispatch.settings import Settings
from outbox_dispatch.worker.drain import DrainReport

__all__ = [
    "Backoff",
    "ConfigurationError",
    "Context",
    "DatabaseError",
    "DatabaseUnavailable",
    "Dispatcher",
    "DrainError",
    "DrainLoop",
    "DrainReport",
    "DrainTimeout",
    "DuplicateRegistration",
    "EnqueuedTask",
    "Family",
    "InvalidArgument",
    "InvalidIdentifier",
    "InvalidPayload",
    "IsolationNotSupported",
    "LostAttempt",
    "MaintenanceFailed",
    "Message",
    "OutboxError",
    "OutboxTask",
    "Outcome",
    "OutsideTransaction",
    "PayloadTooLarge",
    "PermanentFailure",
    "ResultsNotSupported",
    "RetryLater",
    "SchemaNotReady",
    "Settings",
    "StatementCancelled",
    "UnknownCommand",
    "UnknownDatabase",
    "UnknownFamily",
    "using",
]
