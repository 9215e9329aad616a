"""Fork-safe locks: every forked child gets each of them new and unlocked.

Celery's prefork pool forks its children (and forks again whenever one exits) while the
worker's main process may run threads of ours, such as the metrics server's. A child inherits
every lock as it was at the fork: one that such a thread held (creating a connection pool, say)
stays locked forever in the child, whose first delivery then hangs. These locks are replaced
in the child right after the fork, while it has only one thread; what they guard is itself
rebuilt per process (pools, clients, threads) or harmless to keep.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


class ForkSafeLock:
    """A ``threading.Lock`` for ``with`` blocks, new and unlocked in every forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def try_acquire(self) -> bool:
        """Take the lock if it is free, without waiting (pair with ``release``)."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.Lock()


def _after_fork_in_child() -> None:
    for lock in list(_LOCKS):
        lock._renew()


os.register_at_fork(after_in_child=_after_fork_in_child)
