"""Postgres: pools, queries by concern, migrations, roles, the caller's connection, maintenance."""

from outbox_dispatch.store.queries import Store, pipelined_transaction, translated, wake_channel

__all__ = ["Store", "pipelined_transaction", "translated", "wake_channel"]
