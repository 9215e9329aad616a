"""outbox_dispatch: a transactional outbox that delivers through Celery.

Write a row with ``Dispatcher.enqueue`` in the same transaction as your business change; the
claimer moves due rows into Celery queues per family and workers deliver and settle them.
"""

from .dispatcher import Dispatcher
from .drain import DrainReport
from .errors import (
    ConfigurationError,
    DatabaseError,
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
    UnknownFamily,
)
from .handlers import Context
from .policy import Backoff, Family, LostAttempt
from .settle import Outcome
from .tasks import EnqueuedTask, OutboxTask
from .transactions import using
from .validation import Message

__all__ = [
    "Backoff",
    "ConfigurationError",
    "Context",
    "DatabaseError",
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
    "StatementCancelled",
    "UnknownCommand",
    "UnknownFamily",
    "using",
]
