"""What an operator reads and does: counts per family, parked rows listed, retried or purged,
rows found by id, actor or dedupe key, and a row's state."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from psycopg.rows import dict_row

from outbox_dispatch.core.rows import FamilyStatus, RowFilter
from outbox_dispatch.store.connections import StoreBase, translated
from outbox_dispatch.store.ordered import actor_lock


class StatusQueries(StoreBase):
    """Status reads and parked rows' changes (sql/status.sql)."""

    def status(self) -> list[FamilyStatus]:
        with translated("status"), self._starting() as conn:
            rows = conn.execute(self.q["status_families"]).fetchall()
        return [
            FamilyStatus(
                family=r[0],
                due=int(r[1]),
                scheduled=int(r[2]),
                in_flight=int(r[3]),
                parked=int(r[4]),
                cancelled=int(r[5]),
                done=int(r[6]),
                oldest_due_age=float(r[7]),
                maybe_applied=int(r[8]),
            )
            for r in rows
        ]

    def cap_status(
        self, families: list[str]
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str, int]]]:
        """Waiting and blocked counts per family, and in-flight counts per (family, actor)."""
        with translated("status"), self._starting() as conn:
            counts = conn.execute(
                self.q["status_waiting_blocked"], {"families": families}
            ).fetchall()
            actors = conn.execute(
                self.q["status_actors_in_flight"], {"families": families}
            ).fetchall()
        return (
            {r[0]: (int(r[1]), int(r[2])) for r in counts},
            [(r[0], r[1], int(r[2])) for r in actors],
        )

    def parked_list(
        self, *, family: str | None = None, limit: int | None = 100, ids: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """Parked rows, oldest parked first: of ``family``, or those of ``ids`` (None: any)."""
        with (
            translated("parked list"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            params = {"family": family, "limit": limit, "ids": ids}
            return cur.execute(self.q["parked_list"], params).fetchall()

    def parked_retry(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        ordered: Mapping[str, bool] | None = None,
    ) -> list[int]:
        """Parked rows due again, attempts reset; in ordered families the retried rows get back
        in line and an actor without a head gets its lowest row, all in one transaction."""
        return self._parked_change(True, ids, family, ordered or {})

    def parked_purge(
        self,
        *,
        ids: list[int] | None = None,
        family: str | None = None,
        ordered: Mapping[str, bool] | None = None,
    ) -> list[int]:
        """Delete parked rows; an ordered actor whose parked head is gone gets its next row."""
        return self._parked_change(False, ids, family, ordered or {})

    def _parked_change(
        self, retry: bool, ids: list[int] | None, family: str | None, ordered: Mapping[str, bool]
    ) -> list[int]:
        sel = {"ids": ids, "family": family, "limit": 1_000_000}
        query = self.q["parked_retry"] if retry else self.q["parked_purge"]
        action = "parked retry" if retry else "parked purge"
        with translated(action), self._starting() as conn, conn.transaction():
            found = conn.execute(self.q["parked_list"], sel).fetchall()
            lines = sorted({(r[1], r[3]) for r in found if r[1] in ordered and r[3] is not None})
            for fam, actor in lines:
                lock = actor_lock(self.schema, fam, actor)
                conn.execute(self.q["ordered_lock_actor"], {"lock_name": lock})
            chosen = [int(r[0]) for r in found]
            rows = conn.execute(query, {"ids": chosen, "family": None}).fetchall()
            done = sorted(int(r[0]) for r in rows)
            in_line = [int(r[0]) for r in rows if r[1] in ordered and r[2] is not None]
            if retry and in_line:
                conn.execute(self.q["ordered_block_rows"], {"ids": in_line})
            by_family: dict[str, list[str]] = {}
            for fam, actor in lines:
                by_family.setdefault(fam, []).append(actor)
            for fam, actors in by_family.items():
                conn.execute(
                    self.q["ordered_promote"],
                    {"family": fam, "actors": actors, "parked_blocks": ordered[fam]},
                )
        return done

    def find_rows(self, text: str, families: list[str], *, limit: int = 50) -> list[dict[str, Any]]:
        """Rows whose id, exact actor (in ``families``) or exact dedupe key is ``text``."""
        row_id = int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None
        params = {"id": row_id, "text": text, "families": families, "limit": limit}
        with (
            translated("find rows"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(self.q["status_find_rows"], params).fetchall())

    def row_state(self, row_id: int) -> str | None:
        """``parked``, ``cancelled``, ``done`` or ``live``; None when there is no such row."""
        with translated("row state"), self._starting() as conn:
            row = conn.execute(self.q["status_row_state"], {"id": row_id}).fetchone()
        if row is None:
            return None
        parked, cancelled, done = row
        return "parked" if parked else "cancelled" if cancelled else "done" if done else "live"

    def pause(self, family: str, reason: str | None, by: str | None) -> None:
        with translated("pause"), self._starting() as conn:
            conn.execute(self.q["status_pause"], {"family": family, "reason": reason, "by": by})

    def resume(self, family: str) -> bool:
        """False when the family was not paused."""
        with translated("resume"), self._starting() as conn:
            return conn.execute(self.q["status_resume"], {"family": family}).fetchone() is not None

    def paused(self) -> list[dict[str, Any]]:
        """Paused families with when, why and by whom."""
        with (
            translated("paused"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(self.q["status_paused"]).fetchall())

    def audit(
        self, by: str, action: str, selection: Mapping[str, Any], rows: int, reason: str | None
    ) -> None:
        """One operator action in the audit log."""
        params = {
            "by": by,
            "action": action,
            "selection": json.dumps(selection, default=str),
            "rows": rows,
            "reason": reason,
        }
        with translated("audit"), self._starting() as conn:
            conn.execute(self.q["audit_write"], params)

    def audit_list(self, limit: int) -> list[dict[str, Any]]:
        """The latest operator actions, newest first."""
        with (
            translated("audit"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(self.q["audit_list"], {"limit": limit}).fetchall())

    def matching(
        self, where: RowFilter, *, parked: bool, after: int = 0, limit: int = 500
    ) -> list[dict[str, Any]]:
        """One batch of the rows an operator's filter selects, in id order after ``after``."""
        params = {**where.params(parked), "after": after, "limit": limit}
        with (
            translated("select rows"),
            self._starting() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return list(cur.execute(self.q["status_matching"], params).fetchall())

    def matching_count(self, where: RowFilter, *, parked: bool) -> int:
        with translated("count rows"), self._starting() as conn:
            row = conn.execute(self.q["status_matching_count"], where.params(parked)).fetchone()
        return int(row[0]) if row else 0
