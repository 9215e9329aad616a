"""The shop's database: an async SQLAlchemy engine (asyncpg) and its ORM models. Nothing here
knows about the outbox."""

from __future__ import annotations

import os
from datetime import datetime

from sqlalchemy import func
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# a plain postgresql:// URL: the outbox's Dispatcher and the handlers (psycopg) take it as is
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def async_url(url: str) -> str:
    """The same database as SQLAlchemy's asyncpg URL."""
    return url.replace("postgresql://", "postgresql+asyncpg://", 1)


engine = create_async_engine(async_url(DATABASE_URL))
Session = async_sessionmaker(engine, expire_on_commit=False)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    email: Mapped[str]
    cents: Mapped[int]


class Confirmation(Base):
    """A confirmation "sent" for an order (the handler in shop/outbox.py writes it)."""

    __tablename__ = "confirmations"

    order_id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]
    sent_at: Mapped[datetime] = mapped_column(server_default=func.now())


async def create_tables() -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
