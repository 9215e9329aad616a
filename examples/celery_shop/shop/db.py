"""The shop's own tables, on its own connections (nothing here knows about the outbox)."""

from __future__ import annotations

from typing import Any

import psycopg

from .celery import DATABASE_URL


def connect() -> psycopg.Connection[Any]:
    return psycopg.connect(DATABASE_URL)


def create_tables() -> None:
    with connect() as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text NOT NULL,"
            " cents int NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS charges (order_id bigint, attempt int, cents int,"
            " ok boolean)"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS receipts (order_id bigint PRIMARY KEY)")
