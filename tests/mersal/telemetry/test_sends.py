"""Apps without a database on `memory://`: sends published at commit, direct sends, defer."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from opentelemetry.trace import SpanKind

from mersal import App, message
from tests.mersal.telemetry.support import Recorder, linked, parent_id, span_id, trace_id, value
from tests.support import eventually

TOPIC = "tests.mersal.telemetry.Shipped.v1"


@message("tests.mersal.telemetry.Ship.v1")
@dataclass
class Ship:
    parcel: str


@message(TOPIC)
@dataclass
class Shipped:
    parcel: str


def shipping() -> tuple[App, asyncio.Queue[Shipped]]:
    """An app that handles Ship by publishing Shipped, and handles Shipped too."""
    name = f"shipping-{uuid.uuid4().hex[:8]}"
    app = App(name, transport=f"memory://telemetry-{uuid.uuid4().hex}")
    shipped: asyncio.Queue[Shipped] = asyncio.Queue()

    async def ship(command: Ship) -> None:
        await app.publish(Shipped(command.parcel))

    async def note(event: Shipped) -> None:
        shipped.put_nowait(event)

    app.register(Ship, ship)
    app.register(Shipped, note)
    app.route(Ship, name)
    app.subscribe(Shipped)
    return app, shipped


async def test_a_transaction_without_a_database_publishes_at_commit_in_a_send_span(
    otel: Recorder,
) -> None:
    app, shipped = shipping()
    otel.instrument(app)
    async with app:
        with otel.tracer.start_as_current_span("POST /parcels") as request:
            async with app.transaction():
                sent = await app.send(Ship("p-1"))
        assert await asyncio.wait_for(shipped.get(), 5) == Shipped("p-1")
        await eventually(lambda: otel.spans(f"process {app.name}")[1:], "both handled")

    create = otel.span(f"create {app.name}")
    send = otel.span(f"send {app.name}")
    process, process_event = otel.spans(f"process {app.name}")
    create_event = otel.span(f"create {TOPIC}")
    send_event = otel.span(f"send {TOPIC}")
    assert (create.kind, send.kind) == (SpanKind.PRODUCER, SpanKind.CLIENT)
    assert parent_id(create) == span_id(request)
    assert parent_id(send) == span_id(request)  # the commit runs in the request
    assert linked(send) == [span_id(create)]
    assert parent_id(process) == span_id(create)
    assert parent_id(create_event) == span_id(process)
    assert parent_id(send_event) == span_id(process)  # the commit runs in the handler's attempt
    assert linked(send_event) == [span_id(create_event)]
    assert parent_id(process_event) == span_id(create_event)
    everything = otel.spans()
    assert {trace_id(span) for span in everything} == {trace_id(request)}
    assert (send.attributes or {})["messaging.system"] == "memory"
    assert (send.attributes or {})["messaging.message.id"] == sent
    assert "messaging.rabbitmq.destination.routing_key" not in (send.attributes or {})
    assert (process_event.attributes or {})["messaging.destination.name"] == app.name
    sent_messages = otel.points("messaging.client.sent.messages")
    assert value(sent_messages, messaging__system="memory", messaging__destination__name=TOPIC) == 1


async def test_a_send_outside_any_transaction_is_the_creation_and_the_send(otel: Recorder) -> None:
    app, shipped = shipping()
    otel.instrument(app)
    async with app:
        await app.send(Ship("p-2"))
        await asyncio.wait_for(shipped.get(), 5)
        await eventually(lambda: otel.spans(f"process {app.name}")[1:], "both handled")

    send = otel.span(f"send {app.name}")
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is None
    assert otel.spans(f"create {app.name}") == []
    first = otel.spans(f"process {app.name}")[0]
    assert parent_id(first) == span_id(send)
    assert linked(first) == [span_id(send)]
    durations = otel.points("messaging.client.operation.duration")
    assert value(durations, messaging__destination__name=app.name) == 1


async def test_a_deferred_message_is_processed_in_a_trace_of_its_own(otel: Recorder) -> None:
    app, shipped = shipping()
    otel.instrument(app)
    async with app:
        await app.defer(0.05, Ship("p-3"))
        await asyncio.wait_for(shipped.get(), 5)
        await eventually(lambda: otel.spans(f"process {app.name}")[1:], "both handled")

    send = otel.span(f"send {app.name}")
    deferred = otel.spans(f"process {app.name}")[0]
    assert deferred.parent is None
    assert trace_id(deferred) != trace_id(send)
    assert linked(deferred) == [span_id(send)]


async def test_a_trace_context_the_sender_gives_is_kept(otel: Recorder) -> None:
    app, shipped = shipping()
    otel.instrument(app)
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with app:
        async with app.transaction():
            await app.send(Ship("p-4"), headers={"traceparent": theirs})
        await asyncio.wait_for(shipped.get(), 5)
        await eventually(lambda: otel.spans(f"process {app.name}")[1:], "both handled")

    assert otel.spans(f"create {app.name}") == []
    process = otel.spans(f"process {app.name}")[0]
    assert process.context is not None
    assert process.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert parent_id(process) == 0xB7AD6B7169203331


async def test_the_metrics_have_the_units_and_buckets_of_the_conventions(otel: Recorder) -> None:
    app, shipped = shipping()
    otel.instrument(app)
    async with app:
        await app.send(Ship("p-5"))
        await asyncio.wait_for(shipped.get(), 5)
    units = {
        "messaging.client.operation.duration": "s",
        "messaging.client.sent.messages": "{message}",
        "messaging.client.consumed.messages": "{message}",
        "messaging.process.duration": "s",
    }
    assert {name: otel.metric(name).unit for name in units} == units
    for histogram in ("messaging.client.operation.duration", "messaging.process.duration"):
        bounds = otel.points(histogram)[0].explicit_bounds
        assert list(bounds) == [
            0.005,
            0.01,
            0.025,
            0.05,
            0.075,
            0.1,
            0.25,
            0.5,
            0.75,
            1,
            2.5,
            5,
            7.5,
            10,
        ]


@message("tests.mersal.telemetry.Quote.v1")
@dataclass
class Quote:
    parcel: str


@message("tests.mersal.telemetry.Priced.v1")
@dataclass
class Priced:
    parcel: str


async def test_replies_to_any_number_of_reply_addresses_are_one_metric_series(
    otel: Recorder,
) -> None:
    url = f"memory://telemetry-{uuid.uuid4().hex}"
    pricing = App(f"pricing-{uuid.uuid4().hex[:8]}", transport=url)

    async def price(quote: Quote) -> None:
        await pricing.reply(Priced(quote.parcel))

    pricing.register(Quote, price)
    pricing.route(Quote, pricing.name)
    requesters = [App(f"requester-{number}", transport=url) for number in range(3)]
    for requester in requesters:
        requester.route(Quote, pricing.name)
    forged = [f"forged-{number}" for number in range(4)]
    otel.instrument(pricing)
    async with pricing:
        for address in forged:
            await pricing.transport.declare(address)
            await pricing.send(Quote(address), headers={"reply-to": address})
        for requester in requesters:
            async with requester:
                assert await requester.request(Quote("p-6"), reply_type=Priced) == Priced("p-6")
        await eventually(lambda: len(otel.spans("send (reply)")) == 7, "every reply sent")

    sent = otel.points("messaging.client.sent.messages")
    assert sorted(point.attributes["messaging.destination.name"] for point in sent) == [
        "(reply)",
        pricing.name,
    ]
    assert value(sent, messaging__destination__name="(reply)") == 7
    durations = otel.points("messaging.client.operation.duration")
    assert {point.attributes["messaging.destination.name"] for point in durations} == {
        "(reply)",
        pricing.name,
    }
    replies = [dict(span.attributes or {}) for span in otel.spans("send (reply)")]
    assert all(reply["mersal.reply"] is True for reply in replies)
    assert {reply["messaging.destination.name"] for reply in replies} >= set(forged)
    temporary = [reply for reply in replies if reply.get("messaging.destination.temporary")]
    assert len(temporary) == len(requesters)
