"""The per-message transaction: buffered sends leave in order, after the handler, before the ack."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from mersal import App, Delivery, Header, MessageContext, RetryPolicy
from mersal.pipeline import Next
from mersal.testing import Harness
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport


@dataclass
class Batch:
    name: str


@dataclass
class Item:
    n: int


Event = tuple[str, str]


class RecordingDelivery:
    """A delivery that writes its ack/nack into the event log."""

    def __init__(self, inner: Delivery, events: list[Event], acked: asyncio.Event) -> None:
        self.inner = inner
        self.events = events
        self.acked = acked
        self.envelope = inner.envelope
        self.queue = inner.queue
        self.redelivered = inner.redelivered

    async def ack(self) -> None:
        self.events.append(("ack", self.envelope.headers.get(Header.TYPE, "")))
        await self.inner.ack()
        self.acked.set()

    async def nack(self, requeue: bool = True) -> None:
        self.events.append(("nack", self.envelope.headers.get(Header.TYPE, "")))
        await self.inner.nack(requeue)


class RecordingConsumer:
    def __init__(self, inner: object, events: list[Event], acked: asyncio.Event) -> None:
        self.inner = inner
        self.events = events
        self.acked = acked

    async def get(self) -> RecordingDelivery:
        delivery = await self.inner.get()  # type: ignore[attr-defined]
        return RecordingDelivery(delivery, self.events, self.acked)

    async def close(self) -> None:
        await self.inner.close()  # type: ignore[attr-defined]


class RecordingTransport(MemoryTransport):
    """A memory transport that logs every message handed to it and every ack, in order."""

    def __init__(self, url: str, events: list[Event], fail_sends: int = 0) -> None:
        super().__init__(url)
        self.events = events
        self.fail_sends = fail_sends
        self.acked = asyncio.Event()

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        if self.fail_sends and any(m.envelope.type_name == type_of(Item) for m in messages):
            self.fail_sends -= 1
            self.events.append(("send-failed", ""))
            raise ConnectionError("broker went away")
        for outgoing in messages:
            self.events.append(("send", outgoing.envelope.body.decode()))
        return await super().send_each(messages)

    async def consume(  # type: ignore[override]
        self, queue: str, *, prefetch: int
    ) -> RecordingConsumer:
        consumer = await super().consume(queue, prefetch=prefetch)
        return RecordingConsumer(consumer, self.events, self.acked)


def type_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


async def test_sends_leave_in_order_and_only_after_the_handler_returns() -> None:
    sent_all = asyncio.Event()
    release = asyncio.Event()

    async def handle(message: Batch, context: MessageContext) -> None:
        for n in range(3):
            await context.app.send(Item(n))
        sent_all.set()
        await release.wait()

    app = App("batches")
    app.route(Item, "items")
    app.register(Batch, handle)
    async with Harness(app) as bus:
        items = bus.broker.declare("items")
        await app.send_local(Batch("b-1"))
        async with asyncio.timeout(2):
            await sent_all.wait()
        # The handler has sent three messages but has not returned: none has left.
        assert bus.sent_of(Item) == []
        assert len(items) == 0
        release.set()
        await bus.idle()

    assert bus.sent_of(Item) == [Item(0), Item(1), Item(2)]
    assert [stored.envelope.body for stored in items.ready] == [
        b'{"n":0}',
        b'{"n":1}',
        b'{"n":2}',
    ]


@pytest.mark.parametrize(
    ("policy", "through_the_broker"),
    [
        pytest.param(RetryPolicy(immediate=1, delayed=[0.05]), 0, id="immediate retry"),
        pytest.param(RetryPolicy(immediate=0, delayed=[0.05]), 1, id="delayed retry"),
    ],
)
async def test_a_retried_handler_sends_its_messages_once_not_once_per_attempt(
    policy: RetryPolicy, through_the_broker: int
) -> None:
    attempts: list[int] = []

    async def handle(message: Batch, context: MessageContext) -> None:
        attempts.append(context.attempt)
        for n in range(3):
            await context.app.send(Item(n))
        if context.attempt == 1:
            raise RuntimeError("deadlock detected")

    app = App("batches", retry=policy)
    app.route(Item, "items")
    app.register(Batch, handle)
    async with Harness(app) as bus:
        items = bus.broker.declare("items")
        await app.send_local(Batch("b-1"))
        await bus.idle()

    assert attempts == [1, 2]
    assert len(bus.retried) == through_the_broker
    assert bus.sent_of(Item) == [Item(0), Item(1), Item(2)]
    assert len(items) == 3
    assert bus.dead_lettered == []


async def test_the_delivery_is_acked_after_its_messages_reach_the_transport(
    memory_url: str,
) -> None:
    events: list[Event] = []

    async def handle(message: Batch, context: MessageContext) -> None:
        for n in range(3):
            await context.app.send(Item(n))
        events.append(("handler-returns", message.name))

    transport = RecordingTransport(memory_url, events)
    app = App("batches", transport=transport)
    app.route(Item, "items")
    app.register(Batch, handle)

    async with app:
        await app.transport.declare("items")
        await app.send_local(Batch("b-1"))
        async with asyncio.timeout(2):
            await transport.acked.wait()

    assert events == [
        ("send", '{"name":"b-1"}'),  # the test's own send_local
        ("handler-returns", "b-1"),
        ("send", '{"n":0}'),
        ("send", '{"n":1}'),
        ("send", '{"n":2}'),
        ("ack", type_of(Batch)),
    ]


async def test_a_failed_commit_is_not_acked_and_the_message_is_handled_again(
    memory_url: str,
) -> None:
    events: list[Event] = []

    async def handle(message: Batch, context: MessageContext) -> None:
        events.append(("handler", str(context.attempt)))
        await context.app.send(Item(1))

    transport = RecordingTransport(memory_url, events, fail_sends=1)
    app = App(
        "batches",
        transport=transport,
        retry=RetryPolicy(immediate=1, delayed=[]),
    )
    app.route(Item, "items")
    app.register(Batch, handle)

    async with app:
        await app.transport.declare("items")
        await app.send_local(Batch("b-1"))
        async with asyncio.timeout(2):
            await transport.acked.wait()

    assert events[1:] == [
        ("handler", "1"),
        ("send-failed", ""),
        ("handler", "2"),
        ("send", '{"n":1}'),
        ("ack", type_of(Batch)),
    ]


async def test_at_the_end_of_commit_the_messages_are_queued_and_the_delivery_is_unacked() -> None:
    snapshots: list[tuple[int, int]] = []

    async def handle(message: Batch, context: MessageContext) -> None:
        for n in range(3):
            await context.app.send(Item(n))

    app = App("batches")
    app.route(Item, "items")
    app.register(Batch, handle)
    holder: dict[str, Harness] = {}

    async def after_commit(context: MessageContext, next: Next[MessageContext]) -> None:
        broker = holder["bus"].broker
        snapshots.append((len(broker.queues["items"]), broker.queues["batches"].unacked))
        await next(context)

    app.incoming.insert_after("commit", "snapshot", after_commit)
    async with Harness(app) as bus:
        holder["bus"] = bus
        bus.broker.declare("items")
        await app.send_local(Batch("b-1"))
        await bus.idle()
        unacked_at_end = bus.broker.queues["batches"].unacked

    assert app.incoming.names == ["decode", "activate", "dispatch", "commit", "snapshot"]
    assert snapshots == [(3, 1)]
    assert unacked_at_end == 0
