"""Helpers for the RabbitMQ tests: rabbitmqctl, a raw connection to the broker, a relay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from tests.support import eventually, rabbitmqctl, rabbitmqctl_rows

__all__ = ["Broker", "Relay", "bindings_of", "consumers_of", "rabbitmqctl", "relay"]


async def consumers_of(vhost: str, queue: str) -> list[dict[str, Any]]:
    """The broker's consumers of `queue`: their `consumer_tag`, `prefetch_count`, `channel_pid`."""
    columns = ("queue_name", "consumer_tag", "prefetch_count", "channel_pid")
    rows = await asyncio.to_thread(rabbitmqctl_rows, "list_consumers", "-p", vhost, *columns)
    return [row for row in rows if row["queue_name"] == queue]


async def bindings_of(vhost: str, queue: str) -> list[tuple[str, str]]:
    """The broker's bindings to `queue`, as (exchange, routing key), the default one left out."""
    columns = ("source_name", "destination_name", "routing_key")
    rows = await asyncio.to_thread(rabbitmqctl_rows, "list_bindings", "-p", vhost, *columns)
    return [
        (row["source_name"], row["routing_key"])
        for row in rows
        if row["destination_name"] == queue and row["source_name"]
    ]


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


@contextlib.asynccontextmanager
async def relay(url: str) -> AsyncIterator[Relay]:
    """A node on a port of its own that passes every byte on to the real one, until it dies."""
    target = urlsplit(url)
    node = Relay(target.hostname or "127.0.0.1", target.port or 5672)
    await node.start()
    try:
        yield node
    finally:
        await node.die()


class Relay:
    """A TCP relay to RabbitMQ that can die (refusing connections) and come back on its port."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.target = host, port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    def url(self, vhost: str, query: str = "") -> str:
        """The AMQP URL of the relay."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}{query}"

    async def start(self) -> None:
        """Listen (on the same port as before, if it listened before)."""
        self._server = await asyncio.start_server(self._pass, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def die(self) -> None:
        """Stop listening and drop every connection passed on."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def _pass(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target)
        self._writers += [writer, upstream_writer]
        await asyncio.gather(
            self._pipe(reader, upstream_writer),
            self._pipe(upstream_reader, writer),
            return_exceptions=True,
        )

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
