"""Where the shop's broker and database are: the environment, else local defaults."""

from __future__ import annotations

import os

ORDERS_QUEUE = "shop.orders"
"""The worker app's name, so its input queue: where the web layer sends PlaceOrder."""

ORDERS_ERRORS = "shop.orders.error"
"""Where the worker moves a message that failed every attempt."""


def transport() -> str:
    """The broker URL: MERSAL_TRANSPORT, else a RabbitMQ on this machine."""
    return os.environ.get("MERSAL_TRANSPORT") or "amqp://guest:guest@127.0.0.1/"


def database() -> str:
    """The database URL: MERSAL_DATABASE, else a PostgreSQL database `shop` on this machine."""
    return (
        os.environ.get("MERSAL_DATABASE")
        or "postgresql+asyncpg://postgres@127.0.0.1/shop"
    )
