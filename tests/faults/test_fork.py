"""Forked children (Celery's prefork pool) never inherit a lock held by one of the worker's
own threads: a commit listener creating its connection pool while a child was forked left
that child's first delivery hanging forever (one row in a few thousand never settled)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import threading
import time

import pytest

from outbox_dispatch import Dispatcher
from outbox_dispatch.observe import metrics
from outbox_dispatch.store import Store
from outbox_dispatch.store.health import Breaker

pytestmark = pytest.mark.usefixtures("clean")

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
        with store.pool._lock, breaker._lock:
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


def _child_starts_as_a_pool_process(
    d: Dispatcher,
    ready: multiprocessing.synchronize.Event,
    metrics_made: multiprocessing.synchronize.Event,
) -> None:
    from celery import signals
    from prometheus_client import REGISTRY

    if metrics._instruments.cache_info().currsize:  # made by an earlier test in the parent
        for instrument in vars(metrics._instruments()).values():
            REGISTRY.unregister(instrument)
        metrics._instruments.cache_clear()
    signals.worker_process_init.send(sender=None)  # what Celery sends in a new pool process
    if metrics._instruments.cache_info().currsize == 1:
        metrics_made.set()
    own = d.store.pool._pid == os.getpid()  # not the parent's pool, inherited
    pool = d.store.pool._pool if own else None  # opened by the signal
    deadline = time.monotonic() + 5
    while pool is not None and time.monotonic() < deadline:
        if pool.get_stats().get("pool_available", 0) >= 1:
            ready.set()
            break
        time.sleep(0.02)
    d.store.close()


def test_a_pool_process_connects_and_makes_its_metrics_as_it_starts_not_at_its_first_delivery(
    dispatcher: Dispatcher,
) -> None:
    ready, metrics_made = FORK.Event(), FORK.Event()
    child = FORK.Process(
        target=_child_starts_as_a_pool_process, args=(dispatcher, ready, metrics_made)
    )
    child.start()
    child.join(15)
    assert ready.is_set(), "the pool process had no open connection before its first delivery"
    # importing prometheus_client took the first delivery of a new pool process 50-60 ms
    assert metrics_made.is_set(), "the pool process made its metrics at its first delivery"
