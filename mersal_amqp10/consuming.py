"""Consuming: one receiver link (in its own session) per queue, credit-bounded, settled once.

A consumer takes from its queue and from the queue's partitions, each through a receiver
with `prefetch` credit. A receiver that ends (its connection lost, the broker detaching it)
is attached again, after the connection came back, a bounded number of times; then `get()`
raises `ConsumerLost`. A delivery whose receiver ended cannot be settled: the broker has it
back and delivers it again.

Closing gives no more credit and hands out nothing more; once every delivery handed out is
settled, the receivers' sessions end, and the broker puts back what was buffered or still on
the wire, in its order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import proton

from mersal.errors import ConsumerClosed, MersalError
from mersal.messages import Envelope, Header, describe
from mersal_amqp10.connection import Connection
from mersal_amqp10.links import LinkRefused, Receiver
from mersal_amqp10.topology import Topology
from mersal_amqp10.wire import UNREADABLE, Received, decode

log = logging.getLogger("mersal.amqp10")

RESUBSCRIBE_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)
"""The pauses between an ended receiver's attempts to attach again."""
RESTORE_TIMEOUT = 10.0
"""Seconds to declare a queue again before attaching to it."""


class ConsumerLost(ConsumerClosed):
    """The broker ended a receiver and attaching again kept failing."""


class Amqp10Consumer:
    """Deliveries from a queue (and its partitions), through receivers of its own."""

    def __init__(
        self,
        connection: Connection,
        topology: Topology,
        queue: str,
        prefetch: int,
        delays: Sequence[float] = RESUBSCRIBE_DELAYS,
    ) -> None:
        self.queue = queue
        self.prefetch = max(1, prefetch)
        self._connection = connection
        self._topology = topology
        self._delays = delays
        self._sources: list[tuple[str, str]] = []
        self._receivers: list[Receiver] = []
        self._ready = asyncio.Event()
        self._turn = 0
        self._outstanding: set[Amqp10Delivery] = set()
        self._closed = False
        self._failure: str | None = None

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    @property
    def settled_all(self) -> bool:
        """Whether every delivery handed out was settled (or left to the close)."""
        return not self._outstanding

    async def start(self) -> None:
        """Attach a receiver to the queue and to each partition; on failure none stays."""
        self._sources = await self._topology.sources(self.queue)
        engine = await self._connection.ready()
        self._receivers = [
            Receiver(engine, address, self.prefetch, self._ready) for _, address in self._sources
        ]
        try:
            for receiver in self._receivers:
                await receiver.opened()
        except BaseException:
            self._end_receivers()
            raise

    async def get(self) -> Amqp10Delivery:
        """The next delivery, waiting for one (through reconnects)."""
        while True:
            if self._closed:
                raise ConsumerClosed(f"consumer of {self.queue!r} is closed")
            delivery = self._next()
            if delivery is not None:
                return delivery
            if self._failure is not None:
                raise ConsumerLost(self._failure)
            if any(not receiver.usable for receiver in self._receivers):
                await self._attach_again()
                continue
            self._ready.clear()
            await self._ready.wait()

    def _next(self) -> Amqp10Delivery | None:
        """A buffered delivery, taking the receivers in turn."""
        count = len(self._receivers)
        for step in range(count):
            index = (self._turn + step) % count
            receiver = self._receivers[index]
            if receiver.arrived:
                self._turn = index + 1
                delivery, encoded = receiver.arrived.popleft()
                made = Amqp10Delivery(self, receiver, delivery, _read(encoded))
                made.queue = self._sources[index][0]
                self._outstanding.add(made)
                return made
        return None

    async def _attach_again(self) -> None:
        """Attach every ended receiver again, pausing between tries; at the end, give up."""
        for receiver in self._receivers:
            if not receiver.usable:
                log.warning("%s: attaching again", receiver.error)
        error: BaseException | None = None
        for pause in (0.0, *self._delays):
            await asyncio.sleep(pause)
            if self._closed:
                return
            try:
                await self._replace_ended()
            except (LinkRefused, TimeoutError, MersalError) as failure:
                error = failure
                log.warning("consuming %r again failed: %s", self.queue, failure)
                continue
            return
        self._failure = f"could not consume {self.queue!r} again: {error}"

    async def _replace_ended(self) -> None:
        engine = await self._connection.ready()
        for index, receiver in enumerate(self._receivers):
            if receiver.usable:
                continue
            queue, address = self._sources[index]
            receiver.end()
            try:
                async with asyncio.timeout(RESTORE_TIMEOUT):
                    await self._topology.restore(queue)
            except (TimeoutError, MersalError, ConnectionError) as error:
                log.warning("could not declare %r again before consuming it: %s", queue, error)
            fresh = Receiver(engine, address, self.prefetch, self._ready)
            self._receivers[index] = fresh
            await fresh.opened()

    async def close(self) -> None:
        """Stop handing out; once the deliveries handed out are settled, end the receivers."""
        if self._closed:
            return
        self._closed = True
        self._ready.set()
        for receiver in self._receivers:
            receiver.hold()
            receiver.arrived.clear()  # left unsettled: the sessions' end returns them
        if not self._outstanding:
            self._end_receivers()

    async def ended(self) -> None:
        """Wait until the broker ended the receivers' sessions (after `close()`, all settled)."""
        await asyncio.gather(*(receiver.ended() for receiver in self._receivers))

    def settled(self, delivery: Amqp10Delivery) -> None:
        """A delivery handed out was settled (or left to the close)."""
        self._outstanding.discard(delivery)
        if self._closed and not self._outstanding:
            self._end_receivers()

    def _end_receivers(self) -> None:
        for receiver in self._receivers:
            receiver.end()


class Amqp10Delivery:
    """A message received over AMQP 1.0, owed exactly one settlement."""

    __slots__ = (
        "_consumer",
        "_delivery",
        "_receiver",
        "_settled",
        "envelope",
        "queue",
        "redelivered",
    )

    def __init__(
        self,
        consumer: Amqp10Consumer,
        receiver: Receiver,
        delivery: proton.Delivery,
        received: Received,
    ) -> None:
        self._consumer = consumer
        self._receiver = receiver
        self._delivery = delivery
        self._settled = False
        self.envelope = received.envelope
        self.queue = consumer.queue
        self.redelivered = received.redelivered

    async def ack(self) -> None:
        """Accept the message: the broker removes it from its queue."""
        self._settle(proton.Delivery.ACCEPTED)

    async def nack(self, requeue: bool = True) -> None:
        """Release the message to its queue; `requeue=False` rejects it (the broker dead-letters).

        Given back while its consumer closes, it is left to the end of the session, which puts
        it back where it was in the queue.
        """
        if requeue and self._consumer.closed:
            self._settle(None)
        else:
            self._settle(proton.Delivery.RELEASED if requeue else proton.Delivery.REJECTED)

    def _settle(self, outcome: int | None) -> None:
        if self._settled:
            raise MersalError(f"delivery {self.envelope.message_id} was already acked or nacked")
        self._settled = True
        try:
            if outcome is None:
                self._receiver.forget()
            else:
                self._receiver.settle(self._delivery, outcome)
        except LinkRefused as error:
            raise MersalError(
                f"could not settle {describe(self.envelope.headers)} from {self.queue!r}: its "
                f"link is gone ({error}); the broker will deliver it again"
            ) from error
        finally:
            self._consumer.settled(self)


def _read(encoded: bytes) -> Received:
    """The received message; one that is not AMQP 1.0 at all is kept whole, to be refused."""
    try:
        return decode(encoded)
    except Exception as error:  # hostile bytes fail in many ways (overflow, recursion, ...)
        reason = f"{type(error).__name__}: {error}".replace(";", ",")[:200]
        headers = {Header.CONTENT_TYPE: f"{UNREADABLE}; unreadable={reason}"}
        return Received(Envelope(headers, encoded), False)
