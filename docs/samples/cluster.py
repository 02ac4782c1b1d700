"""An app on a RabbitMQ cluster: failover URLs, queue types, partitions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mersal import App, message
from mersal_rabbitmq import RabbitMQTransport


@message("docs.cluster.Shipped.v1")
@dataclass
class Shipped:
    order_id: str
    step: int


# --8<-- [start:urls]
def cluster_app(user: str, password: str, hosts: list[str], vhost: str) -> App:
    """An app that connects to the first of `hosts` that answers."""
    nodes = ";".join(
        f"amqp://{user}:{password}@{host}/{vhost}" for host in hosts
    )
    # or MERSAL_TRANSPORT="amqp://...;amqp://..."
    return App("docs.orders", transport=nodes)
    # --8<-- [end:urls]


# --8<-- [start:classic]
def classic(url: str) -> RabbitMQTransport:
    """Classic queues, for a development broker (quorum is the default)."""
    # or: amqp://host/vhost?queue_type=classic
    return RabbitMQTransport(url, queue_type="classic")
    # --8<-- [end:classic]


# --8<-- [start:partitions]
def partitioned(transport: str, database: str | None = None) -> App:
    """Every instance takes part; one handles an order's messages in order."""
    return App(
        "docs.shipping", transport=transport, database=database, partitions=8
    )
    # --8<-- [end:partitions]


async def main(url: str, dead: str) -> list[tuple[str, int]]:
    """On `dead;url` (a dead node, then a live one): keyed steps in order."""
    app = partitioned(f"{dead};{url}")
    handled: list[tuple[str, int]] = []
    all_six = asyncio.Event()

    async def ship(event: Shipped) -> None:
        handled.append((event.order_id, event.step))
        if len(handled) == 6:
            all_six.set()

    app.register(Shipped, ship)
    app.route(Shipped, app.name)
    async with app:
        for step in range(3):
            for order_id in ("o-1", "o-2"):
                await app.send(Shipped(order_id, step), partition_key=order_id)
        await asyncio.wait_for(all_six.wait(), timeout=10)
    return handled
