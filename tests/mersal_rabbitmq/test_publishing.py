"""Publishes the broker refuses, and frames a raw producer makes odd, on RabbitMQ.

A publish RabbitMQ refuses by closing its channel (a `CC` header that is not an array: 406; a
topic permission: 403) fails alone: the good messages of its batch, and of the batches sent at
the same time, are confirmed and arrive, and the connection (with the consumers on it)
survives. A raw producer's message whose header name or message id is not UTF-8 does not
cost the consumer its connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
import pamqp.encode
import pytest
from pamqp import common

from mersal import (
    App,
    ConfigurationError,
    Envelope,
    Header,
    MessageContext,
    OutcomeUnknown,
    RetryPolicy,
    Unsendable,
    message,
)
from mersal.pipeline import Next
from mersal.transport import Outgoing
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.publishing import refusal
from mersal_sqlalchemy import SqlStorage, attach
from tests.support import (
    Broker,
    eventually,
    management,
    postgres_database,
    private_vhost,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@message("ok.refusals.Good")
@dataclass
class Good:
    """An event the private vhost lets through (topic permission)."""

    job: int
    n: int


@message("bad.refusals.Bad")
@dataclass
class Bad:
    """An event the private vhost refuses (topic permission: 403, the channel is closed)."""

    job: int


@message("work.refusals.Job")
@dataclass
class Job:
    """A command whose handler publishes five Good events, and a Bad one when `refused`."""

    n: int
    refused: bool = False


@message("work.refusals.Slow")
@dataclass
class Slow:
    """A command whose handler waits until the test lets it finish."""

    n: int


@message("work.refusals.Ship")
@dataclass
class Ship:
    """A command sent through the outbox to a sink queue."""

    n: int


@message("tests.refusals.Odd")
@dataclass
class Odd:
    """What a raw producer sends in the UTF-8 test."""

    n: int


def storage_of(app: App) -> SqlStorage:
    """The app's SQL storage."""
    assert isinstance(app.storage, SqlStorage)
    return app.storage


def id_of(outgoing: Outgoing) -> str:
    """The message id of an outgoing message."""
    return outgoing.envelope.headers[Header.MESSAGE_ID]


def outcome(result: Exception | None) -> str | None:
    """A send result by its kind: None (confirmed) or the exception's class name."""
    return None if result is None else type(result).__name__


# A publish refused by closing the channel, in a batch and beside other batches (406, CC).


async def cc_refusing_transport(
    make_transport: Any, broker: Broker, sink: str
) -> RabbitMQTransport:
    """A started transport that lets a CC string through: RabbitMQ closes the channel (406)."""
    transport: RabbitMQTransport = make_transport()
    await transport.start()
    transport.limits = dataclasses.replace(transport.limits, reserved_headers=frozenset())
    await broker.declare(sink, durable=True)
    return transport


def to(sink: str, message_id: str, **headers: str) -> Outgoing:
    """A message to `sink` with this id (and headers)."""
    return Outgoing(sink, Envelope({Header.MESSAGE_ID: message_id, **headers}, b"{}"))


async def test_a_publish_the_broker_refuses_fails_alone_in_its_batch_and_a_later_batch_goes(
    make_transport: Any, broker: Broker, prefix: str
) -> None:
    sink = f"{prefix}.sink"
    transport = await cc_refusing_transport(make_transport, broker, sink)
    received = await broker.record(sink)
    sent: list[Outgoing] = []
    for turn in range(3):  # the same batch shape, one after the other
        batch = [
            *(to(sink, f"good-{turn}-{n}") for n in range(10)),
            to(sink, f"bad-{turn}", CC=sink),
            *(to(sink, f"good-{turn}-{n}") for n in range(10, 20)),
        ]

        results = await transport.send_each(batch)

        assert [outcome(r) for r in results] == [None] * 10 + ["Unsendable"] + [None] * 10, [
            str(r) for r in results if r
        ]
        assert isinstance(results[10], Unsendable)
        sent += batch
    later = [to(sink, f"later-{n}") for n in range(5)]
    assert await transport.send_each(later) == [None] * 5
    wanted = {id_of(o) for o in [*sent, *later] if not id_of(o).startswith("bad")}
    await eventually(lambda: set(received.ids) >= wanted, "every good one", timeout=10)
    assert not [i for i in received.ids if i.startswith("bad")]


async def test_a_publish_the_broker_refuses_costs_batches_sent_beside_it_nothing(
    make_transport: Any, broker: Broker, prefix: str
) -> None:
    sink = f"{prefix}.sink"
    transport = await cc_refusing_transport(make_transport, broker, sink)
    received = await broker.record(sink)
    # Batches sent at once (handlers committing together), every third with a refused message.
    batches = [
        [
            *(to(sink, f"good-{k}-{i}") for i in range(5)),
            *([to(sink, f"bad-{k}", CC=sink)] if k % 3 == 0 else []),
        ]
        for k in range(12)
    ]

    together = await asyncio.gather(*(transport.send_each(batch) for batch in batches))

    for batch, results in zip(batches, together, strict=True):
        expected = ["Unsendable" if id_of(o).startswith("bad") else None for o in batch]
        assert [outcome(r) for r in results] == expected, [str(r) for r in results if r]
    later = [to(sink, f"later-{n}") for n in range(5)]
    assert await transport.send_each(later) == [None] * 5
    sent = [*(o for batch in batches for o in batch), *later]
    wanted = {id_of(o) for o in sent if not id_of(o).startswith("bad")}
    await eventually(lambda: set(received.ids) >= wanted, "every good one", timeout=10)
    assert not [i for i in received.ids if i.startswith("bad")]


# A topic permission (403) on a private vhost: handlers' publishes and the outbox relay.


@pytest.fixture(scope="module")
def refusing_vhost() -> Iterator[str]:
    """A private vhost where guest may publish only `ok.*` and `work.*` topics (403 else)."""
    with private_vhost("mersal-refusals") as url:
        vhost = urllib.parse.quote(url.rsplit("/", 1)[1], safe="")
        topics = {"exchange": "mersal.events", "write": r"^(ok|work)\.", "read": ".*"}
        management("PUT", f"topic-permissions/{vhost}/guest", topics)
        yield url


@pytest.fixture
async def refusing_broker(refusing_vhost: str) -> AsyncIterator[Broker]:
    """The test's own connection to the private vhost (which is deleted at the end, too)."""
    async with Broker.open(refusing_vhost) as broker:
        yield broker


async def test_handlers_whose_publishes_are_refused_cost_the_others_nothing(
    refusing_vhost: str, refusing_broker: Broker, prefix: str
) -> None:
    jobs = 60
    refused = {n for n in range(jobs) if n % 10 == 0}
    calls: Counter[int] = Counter()
    sink = f"{prefix}.events"
    await refusing_broker.declare(sink, durable=True)
    queue = await refusing_broker.channel.get_queue(sink, ensure=False)
    await refusing_broker.channel.declare_exchange(
        "mersal.events", aio_pika.ExchangeType.TOPIC, durable=True
    )
    await queue.bind("mersal.events", routing_key="ok.refusals.Good")
    events = await refusing_broker.record(sink)

    app = App(
        f"{prefix}-jobs",
        transport=refusing_vhost,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{prefix}.error"),
        concurrency=16,
    )

    async def job(message: Job) -> None:
        calls[message.n] += 1
        await asyncio.sleep(0.02)
        for i in range(5):
            await app.publish(Good(message.n, i), headers={Header.MESSAGE_ID: f"g-{message.n}-{i}"})
        if message.refused:
            await app.publish(Bad(message.n))

    app.register(Job, job)
    # The jobs come from another connection, which the app's refusals cannot touch.
    producer = App(f"{prefix}-producer", transport=refusing_vhost)
    producer.route(Job, f"{prefix}-jobs")
    async with app, producer:
        dead = await refusing_broker.record(f"{prefix}.error")
        async with producer.transaction():
            for n in range(jobs):
                await producer.send(Job(n, n in refused))
        wanted = {f"g-{n}-{i}" for n in range(jobs) if n not in refused for i in range(5)}

        def dead_jobs() -> set[int]:
            return {json.loads(body)["n"] for body in dead.bodies}

        async def done() -> bool:
            return (
                dead_jobs() >= refused
                and set(events.ids) >= wanted
                and await refusing_broker.count(f"{prefix}-jobs") == 0
                and app.in_flight == 0
            )

        await eventually(done, "every job handled or dead-lettered", timeout=15)
        assert app.healthy

    assert dead_jobs() == refused  # a dead letter may leave twice (its confirm lost), no more

    twice = {n: k for n, k in calls.items() if k > 1 and n not in refused}
    assert twice == {}, f"good jobs handled more than once: {twice}"
    assert set(calls) == set(range(jobs))


@pytest.fixture
async def database() -> AsyncIterator[str]:
    """A migrated PostgreSQL database of this test's own."""
    async with postgres_database(migrate=True) as url:
        yield url


async def test_refused_outbox_rows_are_parked_promptly_and_the_rows_behind_them_leave(
    refusing_vhost: str, refusing_broker: Broker, prefix: str, database: str
) -> None:
    refused_rows = 150
    sink = f"{prefix}.sink"
    await refusing_broker.declare(sink, durable=True)
    received = await refusing_broker.record(sink)
    app = App(f"{prefix}-relay", transport=refusing_vhost, database=database)
    attach(app, poll_interval=0.5)
    app.route(Ship, sink)
    async with app:
        storage = storage_of(app)
        async with app.transaction():
            for n in range(refused_rows):
                await app.publish(Bad(n))
        async with app.transaction():
            for n in range(5):
                await app.send(Ship(n), headers={Header.MESSAGE_ID: f"ship-{n}"})

        async def judged() -> bool:
            return (
                storage.parked == refused_rows
                and await storage.pending() == 0
                and set(received.ids) >= {f"ship-{n}" for n in range(5)}
            )

        # The relay judges a hundred rows a second or more: 10 s is ample for 150 refused ones.
        await eventually(judged, "refused rows parked, good rows delivered", timeout=10)
        assert not app.healthy  # parked rows wait for an operator
        # Later rows go as usual.
        async with app.transaction():
            await app.send(Ship(5), headers={Header.MESSAGE_ID: "ship-5"})
        await eventually(lambda: "ship-5" in received.ids, "a later row", timeout=10)


async def test_refused_outbox_rows_leave_the_apps_consumer_and_its_deliveries_alone(
    refusing_vhost: str, refusing_broker: Broker, prefix: str, database: str
) -> None:
    refused_rows = 60
    deliveries: Counter[str] = Counter()
    entered: set[str] = set()
    release = asyncio.Event()

    async def count_deliveries(context: MessageContext, next: Next[MessageContext]) -> None:
        deliveries[context.message_id] += 1
        await next(context)

    async def slow(message: Slow, context: MessageContext) -> None:
        entered.add(context.message_id)
        await release.wait()

    name = f"{prefix}-busy"
    app = App(
        name,
        transport=refusing_vhost,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{prefix}.error"),
    )
    attach(app, poll_interval=0.5)
    app.incoming.insert_before("decode", "count", count_deliveries)  # once per delivery
    app.register(Slow, slow)
    app.route(Slow, name)
    slow_ids = {f"slow-{n}" for n in range(5)}
    async with app:
        storage = storage_of(app)
        try:
            for n in range(5):  # in flight on the app's consumer while the relay meets refusals
                await app.send(Slow(n), headers={Header.MESSAGE_ID: f"slow-{n}"})
            await eventually(lambda: entered == slow_ids, "five handlers running", timeout=10)
            async with app.transaction():
                for n in range(refused_rows):
                    await app.publish(Bad(n))

            async def parked() -> bool:
                return storage.parked == refused_rows and await storage.pending() == 0

            await eventually(parked, "the refused rows parked", timeout=10)
        finally:
            release.set()

        async def settled() -> bool:
            return app.in_flight == 0 and await refusing_broker.count(name) == 0

        await eventually(settled, "the slow messages settled", timeout=10)

    # The refusals did not take the consumer's connection: nothing was delivered again (the
    # inbox would hide a second delivery from the handler, not from the pipeline).
    assert dict(deliveries) == dict.fromkeys(slow_ids, 1)


# A raw producer's header name and message id that are not UTF-8, and a timestamp past 9999.


def table_with_raw_names(value: Mapping[str, Any]) -> bytes:
    """pamqp's field table, but names written as raw bytes (surrogate escapes) as they are."""
    if not value:
        return common.Struct.integer.pack(0)
    data = []
    for key, item in sorted(value.items()):
        name = key.encode("utf-8", "surrogateescape")
        data.append(bytes([len(name)]) + name)
        data.append(pamqp.encode.encode_table_value(item))
    out = b"".join(data)
    return common.Struct.integer.pack(len(out)) + out


def raw_short_string(value: str) -> bytes:
    """pamqp's short string, but written as raw bytes (surrogate escapes) as it is."""
    data = value.encode("utf-8", "surrogateescape")
    return common.Struct.byte.pack(len(data)) + data


def far_timestamp(value: object) -> bytes:
    """A timestamp no datetime holds (2**63 - 1 seconds), whatever the producer was given."""
    return common.Struct.timestamp.pack(2**63 - 1)


async def test_a_name_id_or_timestamp_the_amqp_library_cannot_read_costs_the_consumer_nothing(
    url: str, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    handled: Counter[int] = Counter()
    name = f"{prefix}-odd"
    error_queue = f"{prefix}.error"
    app = App(
        name, transport=url, retry=RetryPolicy(immediate=0, delayed=[], error_queue=error_queue)
    )
    assert isinstance(app.transport, RabbitMQTransport)
    broker.watch(app)

    async def odd(message: Odd) -> None:
        handled[message.n] += 1

    app.register(Odd, odd)
    app.route(Odd, name)
    type_name = app.types.name_of(Odd)
    async with app:
        with monkeypatch.context() as patch:  # a producer that writes what it is given
            patch.setitem(pamqp.encode.METHODS, "table", table_with_raw_names)
            patch.setitem(pamqp.encode.METHODS, "shortstr", raw_short_string)
            patch.setitem(pamqp.encode.METHODS, "timestamp", far_timestamp)
            for n, properties in (
                (-1, {"message_id": "odd-name", "headers": {"x-\udcff\udcfe": "v"}}),
                (-2, {"message_id": "odd-id-\udcff\udcfe"}),
                (-3, {"message_id": "far-timestamp", "timestamp": datetime.now(UTC)}),
            ):
                await broker.publish(
                    aio_pika.Message(
                        json.dumps({"n": n}).encode(),
                        type=type_name,
                        content_type=app.codec.content_type,
                        **properties,
                    ),
                    routing_key=name,
                )
        for n in range(1, 6):
            await app.send(Odd(n))

        async def done() -> bool:
            if not all(handled[n] for n in range(1, 6)):
                return False
            dead = await broker.count(error_queue)
            return (
                handled[-1] + handled[-2] + handled[-3] + dead >= 3
                and await broker.count(name) == 0
                and app.in_flight == 0
            )

        await eventually(done, "the odd messages and the next ones settled", timeout=15)
        dead = await broker.count(error_queue)
        assert app.healthy

    assert {n: handled[n] for n in range(1, 6)} == dict.fromkeys(range(1, 6), 1)
    odd = [handled[-1], handled[-2], handled[-3]]
    assert sum(odd) + dead == 3  # each odd one handled or dead-lettered, once
    assert max(odd) <= 1
    assert handled[-3] == 1  # nothing but its timestamp was odd: it is handled


def refused_publish(text: str) -> OutcomeUnknown:
    """A publish whose channel RabbitMQ closed with a 406 saying `text`."""
    try:
        raise OutcomeUnknown("lost its channel") from aiormq.exceptions.ChannelPreconditionFailed(
            text
        )
    except OutcomeUnknown as error:
        return error


def test_a_keyed_send_through_a_node_without_the_hash_plugin_is_kept_with_the_plugin_hint() -> None:
    outgoing = Outgoing("orders", Envelope({Header.PARTITION_KEY: "k"}, b"{}"))
    refused = refused_publish(
        "PRECONDITION_FAILED - Cannot route message through exchange 'orders.partitions' in "
        "vhost 'shop': exchange type x-consistent-hash not found"
    )

    error = refusal(outgoing, refused)

    assert isinstance(error, ConfigurationError) and not isinstance(error, Unsendable)
    assert "rabbitmq-plugins enable rabbitmq_consistent_hash_exchange" in str(error)
    other = refusal(outgoing, refused_publish("PRECONDITION_FAILED - message size 9 is larger"))
    assert isinstance(other, Unsendable) and "rabbitmq-plugins" not in str(other)
