"""An app over AMQP 1.0: the URL, or an Amqp10Transport with options."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

# --8<-- [start:imports]
from mersal import App, message
from mersal_amqp10 import Amqp10Transport

# --8<-- [end:imports]


@message("docs.amqp10.Ping.v1")
@dataclass
class Ping:
    n: int


# --8<-- [start:app]
def build_app(url: str) -> App:
    """`url` is like "amqp10://user:password@rabbit.internal:5672/vhost"."""
    transport = Amqp10Transport(
        url,  # ?reconnect_interval=2, ?queue_type=classic, ...
        queue_type="quorum",  # the queues' type, as on amqp:// (the default)
        publish_timeout=10.0,  # seconds for a send to be accepted
    )
    # or transport=url
    return App("docs.amqp10.pings", transport=transport)
    # --8<-- [end:app]


async def main(url: str) -> list[int]:
    """Send three pings over AMQP 1.0; return what the handler received."""
    app = build_app(url)
    received: list[int] = []
    done = asyncio.Event()

    async def pong(ping: Ping) -> None:
        received.append(ping.n)
        if len(received) == 3:
            done.set()

    app.register(Ping, pong)
    app.route(Ping, app.name)
    async with app:
        for n in range(3):
            await app.send(Ping(n))  # returns once the broker accepted it
        await asyncio.wait_for(done.wait(), timeout=10)
    return sorted(received)
