"""An app on RabbitMQ: the URL, or a RabbitMQTransport with options."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

# --8<-- [start:imports]
from mersal import App, RetryPolicy, message
from mersal_rabbitmq import RabbitMQTransport

# --8<-- [end:imports]


@message("docs.rabbitmq.Ping.v1")
@dataclass
class Ping:
    n: int


# --8<-- [start:app]
def build_app(url: str) -> App:
    """`url` is like "amqp://user:password@rabbit.internal:5672/vhost"."""
    transport = RabbitMQTransport(
        url,
        queue_type="quorum",  # the default; or "classic"
        publish_timeout=10.0,  # seconds for a publish and its confirm
    )
    retry = RetryPolicy(error_queue="docs.pings.error")
    # or transport=url
    return App("docs.pings", transport=transport, retry=retry)
    # --8<-- [end:app]


async def main(url: str) -> list[int]:
    """Send three pings through RabbitMQ; return what the handler received."""
    app = build_app(url)
    received: list[int] = []
    done = asyncio.Event()

    async def pong(ping: Ping) -> None:
        received.append(ping.n)
        if len(received) == 3:
            done.set()

    app.register(Ping, pong)
    app.route(Ping, app.name)
    # declares "docs.pings" (quorum) and "docs.pings.error" (durable)
    async with app:
        for n in range(3):
            await app.send(Ping(n))  # returns once RabbitMQ confirmed it
        await asyncio.wait_for(done.wait(), timeout=10)
    return sorted(received)
