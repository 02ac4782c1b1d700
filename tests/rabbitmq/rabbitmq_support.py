"""Helpers for the RabbitMQ tests: rabbitmqctl, and a raw connection to the broker."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from tests.support import eventually, rabbitmqctl

__all__ = ["Broker", "rabbitmqctl"]


class Broker:
    """The test's own aio-pika connection, to look at and change the broker from outside."""

    def __init__(self, connection: AbstractConnection, channel: AbstractChannel) -> None:
        self.connection = connection
        self.channel = channel
        self.made: set[str] = set()
        self.watched: list[Any] = []

    def watch(self, transport: Any) -> None:
        """Delete the queues `transport` declares (its `queues`) after the test."""
        self.watched.append(transport)

    def leftovers(self) -> set[str]:
        """Every queue to delete after the test."""
        return self.made.union(*(transport.queues for transport in self.watched))

    async def declare(self, name: str, **options: Any) -> None:
        """Declare a queue (deleted after the test)."""
        self.made.add(name)
        await self.channel.declare_queue(name, **options)

    async def publish(self, message: aio_pika.Message, routing_key: str) -> None:
        """Publish a raw message through the default exchange."""
        await self.channel.default_exchange.publish(message, routing_key)

    async def get(self, queue: str, timeout: float = 5.0) -> AbstractIncomingMessage:
        """The next message in `queue` (acked), waiting up to `timeout` seconds."""
        amqp_queue = await self.channel.get_queue(queue, ensure=False)
        message = await eventually(
            lambda: amqp_queue.get(no_ack=True, fail=False),
            f"a message in {queue!r}",
            timeout=timeout,
            interval=0.02,
        )
        assert message is not None
        return message

    async def count(self, queue: str) -> int:
        """How many messages are ready in `queue` (a passive declare, on a channel of its own)."""
        channel = await self.connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)
        finally:
            if not channel.is_closed:
                await channel.close()

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists (a passive declare, on a channel of its own)."""
        return await self._found(lambda channel: channel.declare_queue(queue, passive=True))

    async def exchange_exists(self, exchange: str) -> bool:
        """Whether `exchange` exists (a passive declare, on a channel of its own)."""
        return await self._found(lambda channel: channel.declare_exchange(exchange, passive=True))

    async def _found(self, declare: Callable[[AbstractChannel], Awaitable[object]]) -> bool:
        channel = await self.connection.channel()
        try:
            await declare(channel)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        finally:
            if not channel.is_closed:
                await channel.close()
        return True

    async def delete(self, names: Iterable[str]) -> None:
        """Delete queues (missing ones are fine)."""
        for name in names:
            await self.channel.queue_delete(name)
