"""The shop's HTTP API. ``POST /orders`` writes the order and the outbox row that confirms it
in one transaction: both commit, or neither does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from .db import Confirmation, Order, Session, create_tables, engine
from .outbox import dispatcher


class NewOrder(BaseModel):
    customer: str
    email: str
    cents: int


class OrderOut(BaseModel):
    id: int
    customer: str
    cents: int
    confirmed: bool


class PaymentDeclined(Exception):
    """The step after the enqueue failed: the request ends in a 500, and rolls back."""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await create_tables()
    yield
    await engine.dispose()
    dispatcher.close()


app = FastAPI(lifespan=lifespan)


@app.post("/orders", status_code=201)
async def place_order(new: NewOrder, fail: bool = False) -> dict[str, int]:
    async with Session() as session, session.begin():
        order = Order(customer=new.customer, email=new.email, cents=new.cents)
        session.add(order)
        await session.flush()  # gives the order its id
        await dispatcher.aenqueue(  # awaited on the session's connection, in its transaction
            session,
            "order.confirm",
            {"order": order.id, "email": order.email},
            actor=f"order:{order.id}",
            dedupe_key=f"confirm:{order.id}",
        )
        if fail:  # ?fail=1: as if charging the card failed after the enqueue
            raise PaymentDeclined(f"order {order.id}")  # the order and its row roll back
    return {"id": order.id}  # committed: the worker confirms it


@app.get("/orders/{order_id}")
async def get_order(order_id: int) -> OrderOut:
    async with Session() as session:
        order = await session.get(Order, order_id)
        if order is None:
            raise HTTPException(status_code=404, detail=f"no order {order_id}")
        confirmed = await session.get(Confirmation, order_id) is not None
    return OrderOut(id=order.id, customer=order.customer, cents=order.cents, confirmed=confirmed)
