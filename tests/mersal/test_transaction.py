"""The per-message transaction: buffered sends leave in order, after the handler, before the ack."""

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    ConfigurationError,
    Delivery,
    Header,
    MessageContext,
    RetryPolicy,
    TransactionClosed,
)
from mersal.pipeline import Next
from mersal.testing import Harness
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from tests.mersal.support import (
    ERROR_QUEUE,
    assert_settled,
    broker_of,
    dead_lettered,
    in_queue,
    quiet,
    settled,
)
from tests.support import DelegatingTransport, eventually


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


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Job:
    n: int


@dataclass
class Out:
    text: str


class Broken(Exception):
    """A failure raised on purpose."""


class FailsSecondOnce(DelegatingTransport):
    """Fails the 2nd message of the first batch of 3 or more once; records every batch's ids."""

    def __init__(self, url: str) -> None:
        super().__init__(MemoryTransport(url))
        self.batches: list[list[str]] = []
        self.failed = False

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Send all but the second message of a big batch, the first time."""
        if len(messages) >= 3:
            self.batches.append([m.envelope.headers[Header.MESSAGE_ID] for m in messages])
        if self.failed or len(messages) < 3:
            return await super().send_each(messages)
        self.failed = True
        results = await super().send_each([messages[0], *messages[2:]])
        return [results[0], ConnectionError("lost the second (on purpose)"), *results[1:]]


# A send belongs to the attempt that made it.


async def test_a_task_of_a_failed_attempt_that_sends_later_gets_transaction_closed() -> None:
    go = asyncio.Event()
    late: list[BaseException | None] = []
    tasks: list[asyncio.Task[None]] = []

    async def send_later(app: App) -> None:
        await go.wait()
        try:
            await app.send(Out("from the failed attempt"))
        except BaseException as error:
            late.append(error)
        else:
            late.append(None)

    async def handle(message: Job, context: MessageContext) -> None:
        app = context.app
        if context.attempt == 1:
            tasks.append(asyncio.create_task(send_later(app)))
            raise Broken("attempt 1 fails")
        await app.send(Out("from attempt 2"))
        go.set()  # the task of attempt 1 sends while attempt 2 runs
        async with asyncio.timeout(2):
            await asyncio.gather(*tasks)

    app = App("tasks", retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with Harness(app) as bus:
        outs = bus.broker.declare("outs")
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "tasks")

    [error] = late
    assert isinstance(error, TransactionClosed)
    assert bus.sent_of(Out) == [Out("from attempt 2")]
    assert len(outs) == 1
    assert bus.dead_lettered == []


async def test_a_task_that_sends_after_a_successful_attempt_gets_transaction_closed() -> None:
    go = asyncio.Event()
    tasks: list[asyncio.Task[str]] = []

    async def send_later(app: App) -> str:
        await go.wait()
        return await app.send(Out("too late"))

    async def handle(message: Job, context: MessageContext) -> None:
        tasks.append(asyncio.create_task(send_later(context.app)))

    app = App("tasks", retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with Harness(app) as bus:
        bus.broker.declare("outs")
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        go.set()
        [task] = tasks
        with pytest.raises(TransactionClosed):
            async with asyncio.timeout(2):
                await task
        await bus.idle(timeout=5)
        assert in_queue(bus.broker, "outs") == []

    assert bus.sent_of(Out) == []


async def test_a_transaction_block_inside_a_handler_joins_the_messages_transaction() -> None:
    seen_while_handling: list[list[Out]] = []
    joined: list[bool] = []

    async def handle(message: Job, context: MessageContext) -> None:
        app = context.app
        async with app.transaction() as transaction:
            joined.append(transaction is context.transaction)
            await app.send(Out(f"in the block, attempt {context.attempt}"))
        seen_while_handling.append(bus.sent_of(Out))
        await app.send(Out(f"after the block, attempt {context.attempt}"))
        if context.attempt == 1:
            raise Broken("attempt 1 fails after its block")

    app = App("blocks", retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with Harness(app) as bus:
        bus.broker.declare("outs")
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "blocks")

    assert joined == [True, True]
    assert seen_while_handling == [[], []]  # the block's send waited for the message's commit
    assert bus.sent_of(Out) == [Out("in the block, attempt 2"), Out("after the block, attempt 2")]
    assert bus.dead_lettered == []


async def test_a_failed_block_inside_a_handler_fails_the_attempt_even_if_caught() -> None:
    calls: list[int] = []

    async def handle(message: Job, context: MessageContext) -> None:
        calls.append(context.attempt)
        app = context.app
        try:
            async with app.transaction():
                await app.send(Out("in the block"))
                raise Broken("the block fails")
        except Broken:
            pass  # the handler carries on as if nothing happened
        await app.send(Out("after the block"))

    app = App("blocks", retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with Harness(app) as bus:
        bus.broker.declare("outs")
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "blocks")
        assert len(in_queue(bus.broker, "error")) == 1

    assert calls == [1, 2, 3]
    assert bus.sent_of(Out) == []
    [dead] = bus.dead_lettered
    assert "the block fails" in dead.error_message
    assert dead.attempts == POLICY.max_attempts


async def test_a_transaction_block_on_another_session_inside_a_handler_is_refused() -> None:
    refused: list[BaseException] = []

    async def handle(message: Job, context: MessageContext) -> None:
        app = context.app
        try:
            async with app.transaction(object()):
                await app.send(Out("in the refused block"))
        except ConfigurationError as error:
            refused.append(error)
        await app.send(Out("after"))

    app = App("blocks", retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with Harness(app) as bus:
        bus.broker.declare("outs")
        await app.send_local(Job(1))
        await bus.idle(timeout=5)

    assert len(refused) == 1
    assert bus.sent_of(Out) == [Out("after")]
    assert bus.dead_lettered == []


# Stable ids under partial failure: a retried send keeps its id, two messages never share one.


async def test_a_retry_after_a_partly_failed_commit_resends_under_the_same_ids(
    memory_url: str,
) -> None:
    calls: list[int] = []

    async def handle(message: Job, context: MessageContext) -> None:
        calls.append(context.attempt)
        app = context.app
        await app.send(Out("one"))
        await app.send(Out("two"), headers={Header.MESSAGE_ID: "user-chosen-id"})
        await app.send(Out("three"))

    transport = FailsSecondOnce(memory_url)
    app = App("stable", transport=transport, retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with app:
        await transport.declare("outs")
        broker = transport.inner.broker  # type: ignore[attr-defined]
        await app.send_local(Job(1))
        await eventually(lambda: len(transport.batches) == 2, "two commit attempts", timeout=5)
        await quiet(broker, app)
        assert_settled(broker, "stable")
        arrived = [e.headers[Header.MESSAGE_ID] for e in in_queue(broker, "outs")]

    assert calls == [1, 2]
    first, second = transport.batches
    assert first == second
    assert first[1] == "user-chosen-id"
    assert len(set(first)) == 3
    # What reached the queue twice did so under one id, which an inbox downstream recognises.
    assert Counter(arrived) == {first[0]: 2, "user-chosen-id": 1, first[2]: 2}


async def test_two_messages_get_different_derived_ids(memory_url: str) -> None:
    async def handle(message: Job, context: MessageContext) -> None:
        for _ in range(3):
            await context.app.send(Out(str(message.n)))

    transport = FailsSecondOnce(memory_url)
    transport.failed = True  # no failure: just record the ids
    app = App("stable", transport=transport, retry=POLICY)
    app.register(Job, handle)
    app.route(Out, "outs")
    async with app:
        await transport.declare("outs")
        await app.send_local(Job(1))
        await app.send_local(Job(2))
        await eventually(lambda: len(transport.batches) == 2, "both messages' sends", timeout=5)
    assert len({i for batch in transport.batches for i in batch}) == 6


FAIL_FAST = RetryPolicy(immediate=0, delayed=[], error_queue=ERROR_QUEUE)
"""One attempt, then the error queue."""


@dataclass
class Order:
    amount: int


@dataclass
class Charge:
    amount: int


@dataclass
class Note:
    text: str


# Two different messages that came with one id, and a task a failed attempt left behind.


async def test_two_different_messages_with_one_id_send_messages_with_different_ids(
    memory_url: str,
) -> None:
    middle = App("middle", transport=memory_url)
    producer = App("producer", transport=memory_url)
    producer.route(Order, "middle")
    middle.route(Charge, "down")

    async def on_order(message: Order) -> None:
        await middle.send(Charge(message.amount))

    middle.register(Order, on_order)
    sink = MemoryTransport(memory_url)
    await sink.start()
    try:
        await sink.declare("down")
        async with middle, producer:
            broker = broker_of(middle)
            # A producer that numbers its messages itself, carelessly: one id, two bodies.
            await producer.send(Order(10), headers={Header.MESSAGE_ID: "1"})
            await producer.send(Order(99), headers={Header.MESSAGE_ID: "1"})
            # The same message once more (a duplicate): it derives what the first one did.
            await producer.send(Order(10), headers={Header.MESSAGE_ID: "1"})
            await eventually(
                lambda: len(broker.queues["down"].ready) == 3,
                'three messages waiting in the "down" queue',
                timeout=5,
            )
            down = in_queue(broker, "down")
    finally:
        await sink.stop()

    amounts = [json.loads(envelope.body)["amount"] for envelope in down]
    ids = [envelope.headers[Header.MESSAGE_ID] for envelope in down]
    assert amounts == [10, 99, 10]
    assert ids[0] != ids[1]
    assert ids[2] == ids[0]


async def test_a_task_left_behind_cannot_send_through_app_transaction_after_the_attempt(
    memory_url: str,
) -> None:
    attempt_over = asyncio.Event()
    left_behind: list[asyncio.Task[None]] = []
    outcomes: list[str] = []
    notes: list[str] = []

    app = App("left-behind", transport=memory_url, retry=FAIL_FAST)

    async def later() -> None:
        await attempt_over.wait()
        try:
            async with app.transaction():
                await app.send_local(Note("from a block after the attempt"))
            outcomes.append("sent")
        except TransactionClosed:
            outcomes.append("TransactionClosed")

    async def work(message: Job) -> None:
        left_behind.append(asyncio.get_running_loop().create_task(later()))
        raise Broken("the attempt fails")

    async def note(message: Note) -> None:
        notes.append(message.text)

    app.register(Job, work)
    app.register(Note, note)
    routed: list[Outgoing] = []
    async with app:
        broker = broker_of(app)
        broker.observers.append(routed.append)
        await app.send_local(Job(1))
        await dead_lettered(broker, "left-behind")
        attempt_over.set()
        await asyncio.wait_for(asyncio.gather(*left_behind), 5)
        await eventually(
            lambda: settled(broker, "left-behind"),
            "the delivery settled after the left-behind task ran",
        )

    assert outcomes == ["TransactionClosed"]
    assert notes == []
    note_type = app.types.name_of(Note)
    assert [o for o in routed if o.envelope.headers.get(Header.TYPE) == note_type] == []
