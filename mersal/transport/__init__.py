"""The Transport protocol every broker adapter implements, and what it carries."""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mersal.messages import Envelope, Header
from mersal.transport.limits import Limits


@dataclass(slots=True)
class Outgoing:
    """One message on its way out: the queue it is sent to, or the topic it is published on."""

    address: str
    envelope: Envelope
    publish: bool = False
    checked: bool = False
    """Checked against the transport's limits already (by the app, when it was sent)."""

    @property
    def delay(self) -> float:
        """Seconds until the message may be delivered, from its deliver-at header."""
        return delay_of(self.envelope)


class Delivery(Protocol):
    """A message received from a queue, owed exactly one ack or nack."""

    envelope: Envelope
    queue: str
    redelivered: bool

    async def ack(self) -> None:
        """Remove the message from the queue: it has been dealt with."""
        ...

    async def nack(self, requeue: bool = True) -> None:
        """Give the message back to its queue; `requeue=False` lets the broker dead-letter it."""
        ...


class Consumer(Protocol):
    """A stream of deliveries from one queue, at most `prefetch` unacknowledged at once."""

    async def get(self) -> Delivery:
        """The next delivery, waiting for one."""
        ...

    async def close(self) -> None:
        """Stop receiving; deliveries handed out stay owed, buffered ones go back to the queue."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Moves envelopes between queues; a broker adapter implements this."""

    address: str
    limits: Limits

    async def start(self) -> None:
        """Connect."""
        ...

    async def stop(self) -> None:
        """Disconnect; unacknowledged deliveries return to their queues."""
        ...

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Make sure `queue` exists (a temporary one goes away when the transport stops).

        `partitions` > 0 splits sends with a partition key over that many ordered partitions
        that several consuming processes share (a transport within one process may ignore it).
        """
        ...

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        ...

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Hand all messages to the broker, in order; raise the first failure if any failed."""
        ...

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Try every message, in order; for each, None once the broker holds it, or why not."""
        ...

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Start receiving from `queue`."""
        ...


async def declare_error_queue(transport: Transport, queue: str) -> None:
    """Make sure the error queue `queue` exists, as the kind of queue the transport parks in.

    A transport with a `declare_error_queue(queue)` method (RabbitMQ: a classic queue, which
    operators can read without the broker counting deliveries) declares it so; others declare
    it as any queue.
    """
    special = getattr(transport, "declare_error_queue", None)
    if special is None:
        await transport.declare(queue)
    else:
        await special(queue)


@runtime_checkable
class BindingPruner(Protocol):
    """A transport that can drop the bindings of subscriptions an app no longer has."""

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Stop delivering to `queue` what is published on any topic not in `topics`."""
        ...


def first_failure(results: Sequence[Exception | None]) -> None:
    """Raise the first failure of a `send_each`, if there is one."""
    for result in results:
        if result is not None:
            raise result


def delay_of(envelope: Envelope) -> float:
    """Seconds until an envelope's deliver-at time; 0 when it has none or it has passed."""
    deliver_at = envelope.headers.get(Header.DELIVER_AT)
    if deliver_at is None:
        return 0.0
    try:
        delay = float(deliver_at) - time.time()
    except ValueError:
        return 0.0
    return delay if 0.0 < delay < math.inf else 0.0


def partition_queue(queue: str, index: int) -> str:
    """The name of partition number `index` of a partitioned queue."""
    return f"{queue}.partition.{index}"
