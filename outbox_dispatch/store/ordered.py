"""Ordered families' lines: each actor's lock, and the next row promoted when an actor's head
leaves its line (or a crash left it without one)."""

from __future__ import annotations

from outbox_dispatch.store.connections import StoreBase, translated


def actor_lock(schema: str, family: str, actor: str) -> str:
    """The lock an ordered actor's line changes under: enqueue, cancel, settle, promotion."""
    return f"{schema}.actor.{family}.{actor}"


class OrderedQueries(StoreBase):
    """Promotions and repairs of ordered lines (sql/ordered.sql)."""

    def promote_blocked(self, family: str, actors: list[str], parked_blocks: bool) -> list[int]:
        """Give actors whose head is gone their next row, under each actor's lock."""
        if not actors:
            return []
        with translated("promote ordered"), self._starting() as conn, conn.transaction():
            for actor in sorted(set(actors)):
                conn.execute(
                    self.q["ordered_lock_actor"],
                    {"lock_name": actor_lock(self.schema, family, actor)},
                )
            rows = conn.execute(
                self.q["ordered_promote"],
                {"family": family, "actors": sorted(set(actors)), "parked_blocks": parked_blocks},
            ).fetchall()
        return [int(r[0]) for r in rows]

    def sweep_heads(self, family: str, parked_blocks: bool) -> list[int]:
        """Give every headless actor of an ordered family its next row (crash repair)."""
        with translated("ordered sweep"), self._starting() as conn:
            rows = conn.execute(
                self.q["ordered_headless_actors"],
                {"family": family, "parked_blocks": parked_blocks},
            ).fetchall()
        actors = [r[0] for r in rows]
        return self.promote_blocked(family, actors, parked_blocks) if actors else []

    def unblock(self, family: str, batch: int) -> int:
        """Blocked rows of a family that is not ordered (any more) become due."""
        with translated("unblock"), self._starting() as conn:
            rows = conn.execute(
                self.q["ordered_unblock"], {"family": family, "batch": batch}
            ).fetchall()
        return len(rows)
