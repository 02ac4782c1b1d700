"""One order through RabbitMQ and PostgreSQL: the span tree, its links and the metric points.

A web request sends PlaceOrder in `app.transaction(session)` (an outbox row), the web app's
relay publishes it, the orders app's handler publishes OrderPlaced through its outbox, and the
billing app handles that.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, RetryPolicy, message
from mersal_sqlalchemy import make_engine
from tests.mersal.telemetry.support import Recorder, linked, parent_id, span_id, trace_id, value
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration

EVENTS = "mersal.events"


@message("tests.mersal.telemetry.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str


@message("tests.mersal.telemetry.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str


@dataclass
class Shop:
    """The three apps of the flow and what billing saw."""

    web: App
    orders: App
    billing: App
    billed: asyncio.Queue[OrderPlaced]


def shop(broker: Broker, database: str) -> Shop:
    """The web front end and the orders app (both with the outbox), and billing (without)."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    retry = RetryPolicy(immediate=0, delayed=[], error_queue=f"{prefix}.error")
    web = broker.app(f"{prefix}.web", database=database, retry=retry)
    orders = broker.app(f"{prefix}.orders", database=database, retry=retry)
    billing = broker.app(f"{prefix}.billing", retry=retry)
    billed: asyncio.Queue[OrderPlaced] = asyncio.Queue()

    async def place(command: PlaceOrder) -> None:
        await orders.publish(OrderPlaced(command.order_id))

    async def bill(event: OrderPlaced) -> None:
        billed.put_nowait(event)

    web.route(PlaceOrder, orders.name)
    orders.register(PlaceOrder, place)
    billing.register(OrderPlaced, bill)
    billing.subscribe(OrderPlaced)
    return Shop(web, orders, billing, billed)


async def test_an_order_makes_one_trace_from_the_request_to_billing(
    otel: Recorder, broker: Broker, postgres_url: str
) -> None:
    apps = shop(broker, postgres_url)
    otel.instrument(apps.web, apps.orders, apps.billing)
    engine = make_engine(postgres_url)
    topic = "tests.mersal.telemetry.OrderPlaced.v1"
    orders_queue, billing_queue = apps.orders.name, apps.billing.name
    try:
        async with apps.billing, apps.orders, apps.web, AsyncSession(engine) as session:
            with otel.tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER):
                async with apps.web.transaction(session):
                    placed = await apps.web.send(PlaceOrder("o-1"))
            assert await asyncio.wait_for(apps.billed.get(), 10) == OrderPlaced("o-1")
            await eventually(
                lambda: otel.spans(f"process {EVENTS}:{topic}:{billing_queue}"),
                "billing's process span ends",
            )
    finally:
        await engine.dispose()

    request = otel.span("POST /orders")
    create_order = otel.span(f"create {orders_queue}")
    send_order = otel.span(f"send {orders_queue}")
    process_order = otel.span(f"process {orders_queue}")
    create_event = otel.span(f"create {EVENTS}:{topic}")
    send_event = otel.span(f"send {EVENTS}:{topic}")
    process_event = otel.span(f"process {EVENTS}:{topic}:{billing_queue}")

    # The request, the creations and the processing are one trace, each the parent of the next.
    assert parent_id(create_order) == span_id(request)
    assert parent_id(process_order) == span_id(create_order)
    assert parent_id(create_event) == span_id(process_order)
    assert parent_id(process_event) == span_id(create_event)
    in_trace = [request, create_order, process_order, create_event, process_event]
    assert {trace_id(span) for span in in_trace} == {trace_id(request)}
    assert linked(process_order) == [span_id(create_order)]
    assert linked(process_event) == [span_id(create_event)]
    # Each relay publish is a trace of its own, linked to the message's creation.
    for send, create in ((send_order, create_order), (send_event, create_event)):
        assert send.parent is None
        assert trace_id(send) != trace_id(request)
        assert linked(send) == [span_id(create)]

    assert [span.kind for span in (create_order, send_order, process_order)] == [
        SpanKind.PRODUCER,
        SpanKind.CLIENT,
        SpanKind.CONSUMER,
    ]
    assert [span.kind for span in (create_event, send_event, process_event)] == [
        SpanKind.PRODUCER,
        SpanKind.CLIENT,
        SpanKind.CONSUMER,
    ]
    for span in [*in_trace[1:], send_order, send_event]:
        assert span.status.status_code is StatusCode.UNSET
        assert "error.type" not in (span.attributes or {})

    assert dict(create_order.attributes or {}) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "create",
        "messaging.operation.type": "create",
        "messaging.destination.name": orders_queue,
        "messaging.rabbitmq.destination.routing_key": orders_queue,
        "messaging.message.id": placed,
        "messaging.message.conversation_id": placed,
        "mersal.message.type": "tests.mersal.telemetry.PlaceOrder.v1",
    }
    send_attributes = dict(send_order.attributes or {})
    assert send_attributes.pop("messaging.message.body.size") == len(b'{"order_id":"o-1"}')
    assert send_attributes == {**dict(create_order.attributes or {}), **_operation("send")}

    process_attributes = dict(process_order.attributes or {})
    assert isinstance(process_attributes.pop("messaging.rabbitmq.message.delivery_tag"), int)
    assert process_attributes == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": orders_queue,
        "messaging.rabbitmq.destination.routing_key": orders_queue,
        "messaging.message.id": placed,
        "messaging.message.conversation_id": placed,
        "messaging.message.body.size": len(b'{"order_id":"o-1"}'),
        "mersal.message.type": "tests.mersal.telemetry.PlaceOrder.v1",
        "mersal.attempt": 1,
    }

    event_id = (create_event.attributes or {})["messaging.message.id"]
    assert event_id != placed
    assert (create_event.attributes or {})["messaging.destination.name"] == f"{EVENTS}:{topic}"
    assert (create_event.attributes or {})["messaging.rabbitmq.destination.routing_key"] == topic
    event_attributes = process_event.attributes or {}
    assert event_attributes["messaging.message.id"] == event_id
    assert event_attributes["messaging.message.conversation_id"] == placed
    assert event_attributes["messaging.rabbitmq.destination.routing_key"] == topic
    assert event_attributes["messaging.destination.name"] == f"{EVENTS}:{topic}:{billing_queue}"

    sent = otel.points("messaging.client.sent.messages")
    assert value(sent, messaging__destination__name=orders_queue) == 1
    assert value(sent, messaging__destination__name=f"{EVENTS}:{topic}") == 1
    assert value(sent, error__type="mersal.errors.OutcomeUnknown") == 0
    durations = otel.points("messaging.client.operation.duration")
    assert value(durations, messaging__operation__type="send") == 2
    consumed = otel.points("messaging.client.consumed.messages")
    assert value(consumed, messaging__destination__name=orders_queue) == 1
    assert value(consumed, messaging__destination__name=f"{EVENTS}:{topic}:{billing_queue}") == 1
    processed = otel.points("messaging.process.duration")
    assert value(processed, messaging__system="rabbitmq", messaging__operation__name="process") == 2
    assert all("error.type" not in point.attributes for point in processed)
    assert otel.points("mersal.retries") == []
    assert otel.points("mersal.dead_letters") == []
    pending = otel.points("mersal.outbox.pending")
    assert {point.attributes["mersal.app"] for point in pending} == {
        apps.web.name,
        apps.orders.name,
    }
    assert all(point.value >= 0 for point in pending)


def _operation(name: str) -> dict[str, str]:
    return {"messaging.operation.name": name, "messaging.operation.type": name}


async def test_keyed_deliveries_of_a_partitioned_queue_are_one_series_per_partition(
    otel: Recorder, broker: Broker
) -> None:
    name = f"t{uuid.uuid4().hex[:8]}.orders"
    retry = RetryPolicy(immediate=0, delayed=[], error_queue=f"{name}.error")
    app = broker.app(name, retry=retry, partitions=2)
    handled: list[str] = []

    async def place(command: PlaceOrder) -> None:
        handled.append(command.order_id)

    app.register(PlaceOrder, place)
    app.route(PlaceOrder, name)
    otel.instrument(app)
    keys = [f"customer-{number}" for number in range(8)]
    async with app:
        for key in keys:
            await app.send(PlaceOrder(key), partition_key=key)
        await eventually(lambda: len(handled) == len(keys), "every keyed command handled")

    consumed = otel.points("messaging.client.consumed.messages")
    destinations = {point.attributes["messaging.destination.name"] for point in consumed}
    assert destinations <= {f"{name}.partitions:{name}.partition.{n}" for n in range(2)}
    assert value(consumed) == len(keys)
