"""The orders service: `uvicorn --factory examples.shop.web:create_api`.

A FastAPI app whose Mersal app consumes too: it starts inside the server's
lifespan, waiting for the broker and the database as `mersal run --wait` does,
and runs the payment saga while the server takes requests.
"""

# --8<-- [start:imports]
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from lagom import Container
from pydantic import BaseModel, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from examples.shop.db import Order, Orders
from examples.shop.messages import (
    ChargeOrder,
    OrderPlaced,
    PaymentReceived,
    RefundPayment,
)
from examples.shop.sagas import OrderPayment
from examples.shop.settings import BILLING, ORDERS, Settings
from mersal import App
from mersal_sqlalchemy import attach, make_engine

# --8<-- [end:imports]


# --8<-- [start:shop]
@dataclass
class Shop:
    """The orders service: its app, and sessions on the engine the app uses."""

    bus: App
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    settings: Settings


def create_shop(settings: Settings) -> Shop:
    """The orders service: publishes OrderPlaced, runs the payment saga."""
    # one pool for the requests and the app
    engine = make_engine(settings.database)
    container = Container()
    container[Settings] = settings  # the saga asks for it
    bus = App(ORDERS, transport=settings.transport, container=container)
    # the outbox, the inbox and the sagas use the web's engine
    attach(bus, engine=engine)
    bus.register_saga(OrderPayment)
    bus.subscribe(OrderPlaced)  # its own event starts the saga
    bus.subscribe(PaymentReceived)  # billing's event
    bus.route(ChargeOrder, BILLING)
    bus.route(RefundPayment, BILLING)
    return Shop(
        bus,
        engine,
        async_sessionmaker(engine, expire_on_commit=False),
        settings,
    )
    # --8<-- [end:shop]


# --8<-- [start:lifespan]
def create_api(shop: Shop | None = None) -> FastAPI:
    """The web app (a shop on the environment's settings unless given one)."""
    # uvicorn sets up only its own loggers: show the Mersal app's (mersal.*)
    # too, as `mersal run` does (a no-op where logging is set up already)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shop = shop or create_shop(Settings.from_environment())

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        # tries again while the broker or the database does not answer, then
        # fails the start
        await shop.bus.start(wait=shop.settings.start_wait)
        try:
            yield
        finally:
            # finishes the messages in hand, sends what the outbox holds
            await shop.bus.stop()
            await shop.engine.dispose()

    api = FastAPI(title="shop", lifespan=lifespan)
    api.state.shop = shop
    api.include_router(router)
    return api
    # --8<-- [end:lifespan]


# --8<-- [start:requests]
def get_shop(request: Request) -> Shop:
    """The shop the app was made with."""
    return cast(Shop, request.app.state.shop)


async def get_session(
    shop: Annotated[Shop, Depends(get_shop)],
) -> AsyncIterator[AsyncSession]:
    """A session on the shop's engine, for one request."""
    async with shop.sessions() as session:
        yield session


ShopDep = Annotated[Shop, Depends(get_shop)]
DbSession = Annotated[AsyncSession, Depends(get_session)]


class OrderRequest(BaseModel):
    """The body of POST /orders."""

    order_id: str = Field(min_length=1, max_length=64)
    amount: float = Field(gt=0, allow_inf_nan=False)


class OrderView(BaseModel):
    """An order as the API shows it."""

    order_id: str
    amount: float
    status: str

    @classmethod
    def of(cls, order: Order) -> OrderView:
        """The view of a stored order."""
        return cls(
            order_id=order.order_id, amount=order.amount, status=order.status
        )


router = APIRouter()
# --8<-- [end:requests]


# --8<-- [start:endpoints]
async def take_order(
    bus: App, session: AsyncSession, order_id: str, amount: float
) -> Order:
    """Write the order and publish OrderPlaced in one transaction, committed."""
    async with bus.transaction(session):
        order = Orders(session).add(order_id, amount)
        # an outbox row, sent after commit
        await bus.publish(OrderPlaced(order_id, amount))
    return order


@router.post("/orders", status_code=202)
async def place_order(
    body: OrderRequest, shop: ShopDep, session: DbSession
) -> OrderView:
    """Take an order; the saga charges it."""
    try:
        order = await take_order(shop.bus, session, body.order_id, body.amount)
    except IntegrityError:  # rolled back: no row, nothing sent
        raise HTTPException(
            409, f"order {body.order_id!r} exists already"
        ) from None
    return OrderView.of(order)


@router.get("/orders/{order_id}")
async def get_order(order_id: str, session: DbSession) -> OrderView:
    """An order and its status: "placed", then "paid" or "cancelled"."""
    order = await Orders(session).get(order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id!r}")
    return OrderView.of(order)
    # --8<-- [end:endpoints]
