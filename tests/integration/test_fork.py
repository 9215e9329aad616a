"""Forked children (Celery's prefork pool) never inherit a lock held by one of the worker's
own threads: a commit listener creating its connection pool while a child was forked left
that child's first delivery hanging forever (one row in a few thousand never settled)."""

from __future__ import annotations

import multiprocessing
import threading

from outbox_dispatch import Dispatcher
from outbox_dispatch.health import Breaker
from outbox_dispatch.store import Store

FORK = multiprocessing.get_context("fork")


def _child_query(store: Store, done: multiprocessing.synchronize.Event) -> None:
    with store.connection() as conn:  # the child's own pool, behind the inherited lock
        conn.execute("SELECT 1")
    store.close()
    done.set()


def test_a_child_forked_while_a_thread_holds_the_pools_lock_still_connects(
    dispatcher: Dispatcher, database_url: str
) -> None:
    breaker = Breaker("default")  # as each database of a several-database dispatcher has
    store = Store(database_url, dispatcher.schema, pool_size=1, breaker=breaker)
    done = FORK.Event()
    holding, release = threading.Event(), threading.Event()

    def listener_creating_its_pool() -> None:  # as a listener thread does, at the fork
        with store.pools._lock, breaker._lock:
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=listener_creating_its_pool)
    thread.start()
    try:
        assert holding.wait(5)
        child = FORK.Process(target=_child_query, args=(store, done))
        child.start()
        child.join(10)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        release.set()
        thread.join(5)
        store.close()
    assert not hung, "the forked child hung on a lock its parent's thread held at the fork"
    assert done.is_set() and child.exitcode == 0
