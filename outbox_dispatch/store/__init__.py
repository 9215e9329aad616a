"""Postgres: the pool, queries by concern, migrations, roles, the caller's connection, upkeep."""

from outbox_dispatch.store.claims import ClaimQueries
from outbox_dispatch.store.deliveries import DeliveryQueries
from outbox_dispatch.store.enqueue import EnqueueQueries
from outbox_dispatch.store.ordered import OrderedQueries
from outbox_dispatch.store.runstats import RunStatsQueries
from outbox_dispatch.store.status import StatusQueries
from outbox_dispatch.store.upkeep import UpkeepQueries

__all__ = ["Store"]


class Store(
    EnqueueQueries,
    ClaimQueries,
    DeliveryQueries,
    OrderedQueries,
    StatusQueries,
    UpkeepQueries,
    RunStatsQueries,
):
    """Named queries for one schema, over a fork-safe pool (pool.py): one mixin per concern,
    on the connections of their base (connections.py)."""
