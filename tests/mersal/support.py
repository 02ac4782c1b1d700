"""Helpers the tests of tests/mersal share: looking into a memory broker, an error queue
that refuses dead letters for a while, and a transport that counts every ack and nack."""

from __future__ import annotations

import json
from collections.abc import Sequence

from mersal import App, Delivery, Envelope, MersalError
from mersal.transport import Consumer, Outgoing
from mersal.transport.memory import MemoryBroker, MemoryTransport
from tests.support import DelegatingTransport, eventually

ERROR_QUEUE = "error"


def qualified(cls: type) -> str:
    """`module.QualName` of a class, as the error-type header names it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def broker_of(app: App) -> MemoryBroker:
    """The memory broker under `app`'s transport (wrapped or not)."""
    transport = app.transport
    while isinstance(transport, DelegatingTransport):
        transport = transport.inner
    assert isinstance(transport, MemoryTransport)
    return transport.broker


def in_queue(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """The envelopes waiting in `queue`, in order."""
    return [stored.envelope for stored in broker.queues[queue].ready]


def settled(broker: MemoryBroker, queue: str) -> bool:
    """Whether `queue` has nothing ready and nothing unacknowledged."""
    found = broker.queues[queue]
    return not found.ready and not found.unacked


def assert_settled(broker: MemoryBroker, queue: str) -> None:
    """Nothing of `queue` is left ready or unacknowledged."""
    found = broker.queues[queue]
    assert found.unacked == 0, f"{queue}: {found.unacked} unacked"
    assert not found.ready, f"{queue}: {len(found.ready)} ready"


async def quiet(broker: MemoryBroker, app: App) -> None:
    """Wait until the broker is idle and the app has nothing in flight."""
    await eventually(
        lambda: broker.idle and app.in_flight == 0,
        "the broker idle and nothing in flight",
        timeout=5,
    )


async def dead_lettered(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """Wait until `queue` is settled and the error queue holds a dead letter; what it holds."""
    await eventually(
        lambda: settled(broker, queue) and bool(broker.queues[ERROR_QUEUE].ready),
        f"{queue!r} settled and a dead letter in the error queue",
    )
    return in_queue(broker, ERROR_QUEUE)


def number_of(envelope: Envelope) -> int:
    """The `n` field of a JSON body."""
    return int(json.loads(envelope.body)["n"])


class RefusingErrorQueue(DelegatingTransport):
    """A memory transport whose error queue refuses the first `refusals` messages sent to it."""

    def __init__(self, url: str, refusals: int, error: type[MersalError] = MersalError) -> None:
        super().__init__(MemoryTransport(url))
        self.refusals = refusals
        self.refused = 0
        self.error = error

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Refuse what goes to the error queue while refusals are left; send the rest."""
        results: list[Exception | None] = []
        for outgoing in messages:
            if outgoing.address == ERROR_QUEUE and self.refused < self.refusals:
                self.refused += 1
                results.append(self.error("the error queue is full (reject-publish), on purpose"))
            else:
                results.extend(await self.inner.send_each([outgoing]))
        return results


class CountedDelivery:
    """A delivery that writes down every ack and nack it gets."""

    def __init__(self, inner: Delivery, settles: list[str]) -> None:
        self.inner = inner
        self.envelope = inner.envelope
        self.queue = inner.queue
        self.redelivered = inner.redelivered
        self.settles = settles

    async def ack(self) -> None:
        """Ack, written down."""
        self.settles.append("ack")
        await self.inner.ack()

    async def nack(self, requeue: bool = True) -> None:
        """Nack, written down."""
        self.settles.append("nack" if requeue else "reject")
        await self.inner.nack(requeue)


class CountingConsumer:
    """A consumer whose deliveries write down how they were settled."""

    def __init__(self, inner: Consumer, ledger: list[tuple[str, list[str]]]) -> None:
        self.inner = inner
        self.ledger = ledger

    async def get(self) -> Delivery:
        """The next delivery, counted."""
        delivery = await self.inner.get()
        settles: list[str] = []
        self.ledger.append((delivery.queue, settles))
        return CountedDelivery(delivery, settles)

    async def close(self) -> None:
        """Stop receiving."""
        await self.inner.close()


class CountingTransport(DelegatingTransport):
    """A memory transport that records, per delivery it hands out, every ack and nack."""

    def __init__(self, url: str, *, refuse_to: str | None = None) -> None:
        super().__init__(MemoryTransport(url))
        self.ledger: list[tuple[str, list[str]]] = []
        self.refuse_to = refuse_to
        self.refused = 0

    @property
    def broker(self) -> MemoryBroker:
        """The memory broker underneath."""
        assert isinstance(self.inner, MemoryTransport)
        return self.inner.broker

    def settles(self, queue: str) -> list[list[str]]:
        """How each delivery from `queue` was settled, in the order they were handed out."""
        return [settles for name, settles in self.ledger if name == queue]

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume, counting."""
        return CountingConsumer(await self.inner.consume(queue, prefetch=prefetch), self.ledger)

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Send; the first message to `refuse_to` fails once."""
        if self.refuse_to is None or self.refused:
            return await super().send_each(messages)
        results: list[Exception | None] = []
        for outgoing in messages:
            if outgoing.address == self.refuse_to and not self.refused:
                self.refused += 1
                results.append(ConnectionError("the broker is away (on purpose)"))
            else:
                results.extend(await super().send_each([outgoing]))
        return results
