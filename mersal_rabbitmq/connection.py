"""The connection to RabbitMQ: one aio-pika connection, reconnected across the nodes of a list.

Failover: the address may list several nodes of a cluster, full URLs separated by `;` (as
kombu takes them). The first that answers is used. When the connection is lost, a round of
attempts starts at once with the next node and goes round the list; a round in which no node
answered is followed by a pause (the URL's `reconnect_interval`, 1 s by default, doubled after
each such round up to `MAX_PAUSE`) and one log line naming each node's reason. Logs name the
node.

The transport keeps one plain aio-pika connection for its life and connects it again itself,
its `url` moved to the node to try (aio-pika's robust connection tries one URL at a fixed
interval, and stays down for good when one of its channels cannot be restored; it is not
used). The channels on it are of two kinds (see `channels`): plain ones, replaced by their
owners when closed, and each consumer's restored channel, which aio-pika reopens when its
consumer asks. Once reconnected, `on_reconnect` hears of it (the transport declares its
topology again); each consumer heard its channel close and restores it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel
from aio_pika.connection import make_url
from yarl import URL

from mersal.errors import ConfigurationError, MersalError
from mersal.urls import mask
from mersal_rabbitmq import patches
from mersal_rabbitmq.channels import Cancelled, RestoredChannel
from mersal_rabbitmq.failures import closed_under, connect_failure, why, worst
from mersal_rabbitmq.urls import nodes_of, seconds_option, take_option

log = logging.getLogger("mersal.rabbitmq")

RECONNECT_INTERVAL = 1.0
"""Seconds of the first pause after a round of reconnect attempts in which no node answered,
unless the URL's `reconnect_interval` says otherwise; each further such round doubles it."""
MAX_PAUSE = 30.0
"""The longest pause between two rounds of reconnect attempts."""
CONNECT_TIMEOUT = 10.0
"""Seconds one attempt to connect to a node may take (a node can take the TCP connection and
never answer): then the next node is tried."""


class Connection:
    """One connection to RabbitMQ (to one node of a list), reconnected; channels on it."""

    def __init__(self, address: str) -> None:
        self.address = address
        address, interval = take_option(address, "reconnect_interval")
        self.nodes = nodes_of(address)
        """The URLs of the nodes to try, in order: one, or several for failover."""
        self.pause = (
            seconds_option(interval, "reconnect_interval") if interval else RECONNECT_INTERVAL
        )
        """Seconds of the first pause after a round of reconnect attempts that all failed."""
        self.index = 0
        """The node connected to, or to be tried next: an index into `nodes`."""
        self.current: aio_pika.Connection | None = None
        """The aio-pika connection, from `open()` until `close()`, reconnected meanwhile."""
        self.on_reconnect: Callable[[], None] | None = None
        """Hears that the connection is up again after it was lost."""
        self._options: dict[str, Any] = {}
        self._closed = asyncio.Event()  # wakes whoever waits for a reconnect, at close()
        self._up = asyncio.Event()  # set while `current` is connected
        self._reconnecting: asyncio.Task[None] | None = None

    @property
    def node(self) -> str:
        """The URL (password masked) of the node connected to, or to be tried next."""
        return mask(self.nodes[self.index])

    def require(self) -> aio_pika.Connection:
        """The aio-pika connection; raises while not open."""
        if self.current is None:
            raise MersalError(
                f"the RabbitMQ transport for {mask(self.address)} is not running (never "
                "started, or stopped): nothing was sent or declared; `await transport.start()` "
                "first"
            )
        return self.current

    @property
    def connected(self) -> bool:
        """Whether the connection to RabbitMQ is up right now."""
        connection = self.current
        if connection is None or not self._up.is_set() or not connection.connected.is_set():
            return False
        transport = connection.transport
        return transport is not None and not transport.connection.is_closed

    async def open(self, heartbeat: int | None) -> aio_pika.Connection:
        """Connect to the first node that answers; from now on, reconnect when it is lost."""
        self._options = {} if heartbeat is None else {"heartbeat": heartbeat}
        failures: list[MersalError] = []
        connection: aio_pika.Connection | None = None
        for index in range(len(self.nodes)):
            try:
                if connection is None:
                    connection = aio_pika.Connection(self._url(index))
                await self._attempt(connection, index)
            except ValueError as error:
                raise ConfigurationError(
                    f"{mask(self.nodes[index])} is not a usable AMQP URL ({error}): "
                    "use amqp://user:password@host:port/vhost"
                ) from None
            except (OSError, aiormq.exceptions.AMQPError) as error:
                failures.append(connect_failure(self.nodes[index], error, reason(error)))
                if index + 1 < len(self.nodes):
                    log.warning("%s; trying the next node", failures[-1])
                continue
            self._closed = asyncio.Event()
            connection.close_callbacks.add(self._on_close)
            self._attach(connection, index)
            return connection
        raise worst(failures)

    async def close(self) -> None:
        """Stop reconnecting, and disconnect."""
        connection, self.current = self.current, None
        self._closed.set()
        self._up.clear()
        reconnecting, self._reconnecting = self._reconnecting, None
        if reconnecting is not None and not reconnecting.done():
            reconnecting.cancel()
            await asyncio.gather(reconnecting, return_exceptions=True)
        if connection is not None:
            await connection.close()

    async def ready(self) -> None:
        """Wait until the connection is up (it reconnects by itself); raises once closed."""
        self.require()
        if self.connected:
            return
        reconnected = asyncio.ensure_future(self._up.wait())
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((reconnected, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reconnected.cancel()
            closed.cancel()
        if not reconnected.done() or reconnected.cancelled():
            self.require()  # closed meanwhile: says so
        reconnected.result()

    async def channel(self, *, confirms: bool = False) -> AbstractChannel:
        """A new plain channel, guarded, once connected: not restored, its owner replaces it."""
        await self.ready()
        channel = aio_pika.Channel(
            self.require(), publisher_confirms=confirms, on_return_raises=confirms
        )
        await self._opening(channel)
        await patches.guard(channel)
        return channel

    async def restored_channel(self, cancelled: Cancelled) -> RestoredChannel:
        """A new restored channel, once connected: `cancelled` hears the broker's cancels."""
        await self.ready()
        channel = RestoredChannel(self.require(), cancelled)
        await self._opening(channel)
        return channel

    async def _opening(self, channel: AbstractChannel) -> None:
        """Open `channel` in Mersal's context; a connection that closes meanwhile is lost."""
        opening = asyncio.create_task(channel.initialize(), context=patches.own_context())
        try:
            await opening
        except BaseException as error:
            lost = closed_under(error, not self.connected, "the connection closed under it")
            if lost is None:
                raise
            raise lost from error

    def _url(self, index: int) -> URL:
        return make_url(self.nodes[index], **self._options)

    async def _attempt(self, connection: aio_pika.Connection, index: int) -> None:
        """Connect to node `index`, within `CONNECT_TIMEOUT`, read the way Mersal reads."""
        connection.url = self._url(index)
        connecting = patches.own_context()  # the connection's reader task inherits it
        await asyncio.create_task(connection.connect(timeout=CONNECT_TIMEOUT), context=connecting)

    def _attach(self, connection: aio_pika.Connection, index: int) -> None:
        self.current, self.index = connection, index
        self._up.set()
        if not connection.connected.is_set():  # closed before the callback was there to hear it
            self._on_close(connection, None)

    def _on_close(self, connection: object, error: BaseException | None) -> None:
        if self._closed.is_set():
            return  # closed by close()
        self._up.clear()
        if self._reconnecting is None or self._reconnecting.done():
            own = contextvars.Context()  # nothing of the closing reader's context
            self._reconnecting = asyncio.create_task(
                self._reconnect(error), name="mersal-rabbitmq reconnect", context=own
            )

    async def _reconnect(self, error: BaseException | None) -> None:
        """Rounds of attempts over the nodes, the lost one last, pausing longer each time."""
        lost, count = self.index, len(self.nodes)
        order = [(lost + step) % count for step in range(1, count + 1)]
        then = f"trying {mask(self.nodes[order[0]])} next" if count > 1 else "reconnecting"
        log.warning("lost the connection to RabbitMQ at %s (%s); %s", self.node, why(error), then)
        pause, connection = self.pause, self.require()
        while True:
            passed: list[str] = []
            for index in order:
                try:
                    await self._attempt(connection, index)
                except Exception as failure:
                    passed.append(f"{mask(self.nodes[index])}: {reason(failure)}")
                    log.debug("reconnecting to RabbitMQ: %s", passed[-1])
                    continue
                self._attach(connection, index)
                if not self._up.is_set():  # lost again at once
                    passed.append(f"{mask(self.nodes[index])}: closed as it opened")
                    continue
                self._on_reconnect(passed)
                return
            log.warning("%s; next round in %g s", _round_failed(passed), pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, max(MAX_PAUSE, self.pause))

    def _on_reconnect(self, passed: Sequence[str]) -> None:
        log.info(
            "reconnected to RabbitMQ at %s%s; declaring the topology again and consuming again",
            self.node,
            f" (passed over {'; '.join(passed)})" if passed else "",
        )
        if self.on_reconnect is not None:
            self.on_reconnect()


def _round_failed(passed: Sequence[str]) -> str:
    """The line for a round of reconnect attempts in which no node answered."""
    if len(passed) == 1:
        return f"reconnecting to RabbitMQ failed ({passed[0]})"
    return f"all {len(passed)} RabbitMQ nodes failed ({'; '.join(passed)})"


def reason(error: BaseException) -> str:
    """Why an attempt to connect failed, for a message or a log line."""
    if isinstance(error, TimeoutError):  # raised bare by the attempt's time limit
        return f"no answer within {CONNECT_TIMEOUT:g} s"
    return why(error)
