"""The web front end: `uvicorn --factory examples.fastapi_orders.web:create_api`.

One engine serves both the endpoints and the send-only App's outbox and relay, so a request's
session and the outbox rows it writes share one pool and one database transaction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from examples.fastapi_orders import settings
from examples.fastapi_orders.db import Order, Orders
from examples.fastapi_orders.messages import PlaceOrder
from mersal import App
from mersal_sqlalchemy import attach, make_engine

WEB_APP = "shop.web"
"""The send-only app's name: the `source` header of what it sends; it has no queue."""


@dataclass
class Shop:
    """What the endpoints share: the bus and the sessions on the one engine."""

    bus: App
    sessions: async_sessionmaker[AsyncSession]


# --8<-- [start:lifespan]
def create_api(
    *, transport: str | None = None, database: str | None = None
) -> FastAPI:
    """The web app (the settings' broker and database unless given others)."""
    engine = make_engine(database or settings.database())  # the one pool
    bus = App(
        WEB_APP, transport=transport or settings.transport(), consume=False
    )
    bus.route(PlaceOrder, settings.ORDERS_QUEUE)
    # the outbox and its relay use the web layer's engine
    attach(bus, engine=engine)

    @asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        api.state.shop = Shop(
            bus, async_sessionmaker(engine, expire_on_commit=False)
        )
        try:
            # starts the relay; leaving sends what waits, then stops
            async with bus:
                yield
        finally:
            # ours: attach(engine=...) leaves it to its owner
            await engine.dispose()

    api = FastAPI(title="shop", lifespan=lifespan)
    api.include_router(router)
    return api
    # --8<-- [end:lifespan]


# --8<-- [start:dependencies]
def get_shop(request: Request) -> Shop:
    """The bus and the sessions the lifespan set up."""
    return cast(Shop, request.app.state.shop)


async def get_session(
    shop: Annotated[Shop, Depends(get_shop)],
) -> AsyncIterator[AsyncSession]:
    """A session on the bus's engine, for one request."""
    async with shop.sessions() as session:
        yield session


def get_bus(shop: Annotated[Shop, Depends(get_shop)]) -> App:
    """The send-only app."""
    return shop.bus


DbSession = Annotated[AsyncSession, Depends(get_session)]
Bus = Annotated[App, Depends(get_bus)]
# --8<-- [end:dependencies]


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


# --8<-- [start:endpoint]
@router.post("/orders", status_code=202)
async def place_order(
    body: OrderRequest, session: DbSession, bus: Bus
) -> OrderView:
    """Take an order: its row and its PlaceOrder commit together, or neither."""
    try:
        # commits the session on a clean exit
        async with bus.transaction(session):
            order = Orders(session).add(body.order_id, body.amount)
            # an outbox row
            await bus.send(PlaceOrder(body.order_id, body.amount))
    except IntegrityError:  # rolled back: no row, nothing sent
        raise HTTPException(
            409, f"order {body.order_id!r} exists already"
        ) from None
    return OrderView.of(order)
    # --8<-- [end:endpoint]


@router.get("/orders/{order_id}")
async def get_order(order_id: str, session: DbSession) -> OrderView:
    """An order and its status ("placed", then "billed" once the worker handled it)."""
    order = await Orders(session).get(order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id!r}")
    return OrderView.of(order)
