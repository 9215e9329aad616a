"""Rebuilding the cap semaphores after Redis lost them. Caps are global: one actor's rows in
every database count against one cap, so the semaphores are complete only with the live leases
of every database. Each database's caps lock is held, exclusively, from reading its leases until
the restored set is marked complete, so no capped claim anywhere takes a slot in between; the
locks are taken in the order of the databases' names, the same in every process whatever order
its configuration lists them in (locks on two servers can deadlock past Postgres's sight). A
database that cannot be read stops the rebuild (capped rows everywhere wait for it): restoring
without its holders would let their actors past their caps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack

from outbox_dispatch.core.rows import Holder
from outbox_dispatch.store import Store


def rebuild(
    stores: Sequence[Store],
    families: list[str],
    restore: Callable[[list[Holder]], None],
    drop: Callable[[list[Holder]], None],
) -> int:
    """Hand every live holder of the capped ``families`` to ``restore`` while all the caps
    locks are held, then ``drop`` those whose row settled meanwhile; returns how many."""
    found: list[tuple[Store, list[Holder]]] = []
    with ExitStack() as locks:
        for store in sorted(stores, key=lambda s: s.name):
            found.append((store, locks.enter_context(store.caps_frozen(families))))
        restore([h for _, holders in found for h in holders])
    for store, holders in found:
        still = store.leases_held([h.token for h in holders])
        gone = [h for h in holders if h.token not in still]
        if gone:
            drop(gone)
    return sum(len(holders) for _, holders in found)
