"""Helpers for the RabbitMQ tests: rabbitmqctl, consumers and bindings, a relay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from tests.support import rabbitmqctl, rabbitmqctl_rows

__all__ = ["Relay", "bindings_of", "consumers_of", "rabbitmqctl", "relay"]


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
