"""The AMQP 1.0 connection, connected again with backoff when it is lost, and its senders.

`Connection.ready()` is the open engine, waiting through a reconnect. One sender link per
address is kept (`sender`) and made again on the next connection.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass

from mersal.errors import MersalError
from mersal_amqp10.engine import Engine, connect
from mersal_amqp10.links import Sender

log = logging.getLogger("mersal.amqp10")

MAX_RECONNECT_INTERVAL = 30.0


@dataclass(frozen=True, slots=True)
class Peer:
    """Where to connect and as whom."""

    host: str
    port: int
    user: str | None
    password: str
    vhost: str
    tls: ssl.SSLContext | None = None


class Connection:
    """An AMQP 1.0 connection that comes back by itself once it was opened."""

    def __init__(self, peer: Peer, *, reconnect_interval: float = 1.0) -> None:
        self.peer = peer
        self.reconnect_interval = reconnect_interval
        self.engine: Engine | None = None
        self.generation = 0
        """How many times the connection was opened: a consumer sees that it changed."""
        self._senders: dict[str, Sender] = {}
        self._up = asyncio.Event()
        self._watching: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def connected(self) -> bool:
        """Whether the connection is open right now."""
        return self._up.is_set()

    async def open(self) -> None:
        """Connect (raising if the broker does not answer); from then on, reconnect when lost."""
        self._closing = False
        await self._connect()
        self._watching = asyncio.create_task(self._watch(), name="mersal-amqp10-reconnect")

    async def ready(self) -> Engine:
        """The open engine, waiting while the connection comes back."""
        while True:
            if self._closing:
                raise MersalError("the AMQP 1.0 connection is closed")
            engine = self.engine
            if engine is not None and self._up.is_set():
                return engine
            await self._up.wait()

    def cached_sender(self, address: str) -> Sender | None:
        """The sender link to `address`, if there is one still usable."""
        sender = self._senders.get(address)
        return sender if sender is not None and sender.usable else None

    async def sender(self, address: str) -> Sender:
        """The sender link to `address` on the open connection (made on first use)."""
        sender = self._senders.get(address)
        if sender is not None and sender.usable:
            return sender
        if sender is not None:
            sender.end()  # its session, if the broker ended only the link
        engine = await self.ready()
        sender = self._senders[address] = Sender(engine, address)
        return sender

    def drop_sender(self, sender: Sender) -> None:
        """Forget a sender that failed, ending its link, so that the next send makes another."""
        if self._senders.get(sender.address) is sender:
            del self._senders[sender.address]
        sender.end()

    async def close(self) -> None:
        """Close the connection for good: the broker returns what was not settled."""
        self._closing = True
        self._up.set()  # wake those waiting in ready(), who then raise
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None
        engine, self.engine = self.engine, None
        self._senders.clear()
        if engine is not None:
            engine.close()
            try:
                async with asyncio.timeout(2.0):
                    await asyncio.shield(engine.closed)
            except TimeoutError:
                engine.abort()
        self._up.clear()

    async def _connect(self) -> None:
        peer = self.peer
        self.engine = await connect(
            peer.host,
            peer.port,
            user=peer.user,
            password=peer.password,
            vhost=peer.vhost,
            tls=peer.tls,
        )
        self._senders.clear()
        self.generation += 1
        self._up.set()

    async def _watch(self) -> None:
        """Wait for the connection to end, then connect again, pausing longer each time."""
        while not self._closing:
            assert self.engine is not None
            error = await asyncio.shield(self.engine.closed)
            self._up.clear()
            log.warning("lost the AMQP 1.0 connection to %s: %s", self.peer.host, error)
            pause = self.reconnect_interval
            while not self._closing:
                await asyncio.sleep(pause)
                try:
                    await self._connect()
                except (OSError, TimeoutError, ConnectionError) as failure:
                    log.warning(
                        "could not connect to %s again (%s); next try in %.0fs",
                        self.peer.host,
                        failure,
                        min(pause * 2, MAX_RECONNECT_INTERVAL),
                    )
                    pause = min(pause * 2, MAX_RECONNECT_INTERVAL)
                    continue
                log.info("connected to %s again over AMQP 1.0", self.peer.host)
                break
