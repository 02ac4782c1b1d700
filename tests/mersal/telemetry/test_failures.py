"""A handler that always fails: its attempts' spans, the retry and dead-letter counters."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from mersal import App, Outgoing, RetryPolicy, message
from mersal.messages import Envelope, Header
from mersal.plugins import transport_from
from tests.mersal.telemetry.support import Recorder, linked, parent_id, span_id, trace_id, value
from tests.support import Broker, eventually

BOOM = "tests.mersal.telemetry.test_failures.Boom"


class Boom(Exception):
    """The handler's failure."""


@message("tests.mersal.telemetry.Charge.v1")
@dataclass
class Charge:
    amount: int


MakeApp = Callable[[str, RetryPolicy], App]


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.integration)])
async def make_app(request: pytest.FixtureRequest) -> AsyncIterator[MakeApp]:
    """Apps on a memory broker of the test's own, or on RabbitMQ."""
    if request.param == "memory":
        url = f"memory://telemetry-{uuid.uuid4().hex}"
        yield lambda name, retry: App(name, transport=url, retry=retry)
        return
    async with Broker.open(request.getfixturevalue("amqp_url")) as broker:
        yield lambda name, retry: broker.app(name, retry=retry)


async def dead_letter(app: App) -> Envelope:
    """The first message in the app's error queue (taken off it)."""
    transport = transport_from(app.transport.address)
    await transport.start()
    try:
        consumer = await transport.consume(app.retry.error_queue, prefetch=1)
        async with asyncio.timeout(10):
            delivery = await consumer.get()
        await delivery.ack()
        await consumer.close()
        return delivery.envelope
    finally:
        await transport.stop()


async def test_each_attempt_is_a_failed_span_and_the_retries_start_new_traces(
    otel: Recorder, make_app: MakeApp
) -> None:
    name = f"billing-{uuid.uuid4().hex[:8]}"
    app = make_app(name, RetryPolicy(immediate=1, delayed=[0.05], error_queue=f"{name}.error"))

    async def charge(command: Charge) -> None:
        raise Boom(f"cannot charge {command.amount}")

    app.register(Charge, charge)
    app.route(Charge, name)
    otel.instrument(app)
    async with app:
        sent = await app.send(Charge(5))
        await eventually(lambda: len(otel.spans(f"process {name}")) == 3, "three attempts")
        dead = await dead_letter(app)

    send = otel.span(f"send {name}")
    attempts = otel.spans(f"process {name}")
    assert send.kind is SpanKind.PRODUCER  # sent outside a transaction: it is the creation
    assert [(span.attributes or {})["mersal.attempt"] for span in attempts] == [1, 2, 3]
    first, immediate, delayed = attempts
    assert parent_id(first) == span_id(send)
    assert trace_id(first) == trace_id(send)
    for retry in (immediate, delayed):
        assert retry.parent is None
        assert trace_id(retry) not in {trace_id(send), trace_id(first)}
    assert trace_id(immediate) != trace_id(delayed)
    for attempt in attempts:
        assert attempt.kind is SpanKind.CONSUMER
        assert linked(attempt) == [span_id(send)]
        assert (attempt.attributes or {})["error.type"] == BOOM
        assert (attempt.attributes or {})["messaging.message.id"] == sent
        assert attempt.status.status_code is StatusCode.ERROR
        assert [event.name for event in attempt.events] == ["exception"]

    assert dead.headers[Header.ERROR_TYPE] == BOOM
    assert dead.headers["traceparent"] == _traceparent_of(send)

    retries = otel.points("mersal.retries")
    assert value(retries, mersal__retry__kind="immediate", messaging__destination__name=name) == 1
    assert value(retries, mersal__retry__kind="delayed", messaging__destination__name=name) == 1
    dead_letters = otel.points("mersal.dead_letters")
    assert value(dead_letters, error__type=BOOM, messaging__destination__name=name) == 1
    assert value(otel.points("messaging.client.consumed.messages")) == 2  # first and delayed
    assert value(otel.points("messaging.process.duration"), error__type=BOOM) == 3


def _traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def test_a_message_that_cannot_be_decoded_is_a_failed_process_span(
    otel: Recorder, make_app: MakeApp
) -> None:
    name = f"billing-{uuid.uuid4().hex[:8]}"
    app = make_app(name, RetryPolicy(immediate=0, delayed=[], error_queue=f"{name}.error"))

    async def charge(command: Charge) -> None:
        pass

    app.register(Charge, charge)
    otel.instrument(app)
    async with app:
        unknown = Envelope({Header.MESSAGE_ID: "m-1", Header.TYPE: "nobody.Knows.v1"}, b"{}")
        await app.transport.send([Outgoing(name, unknown)])
        await eventually(lambda: otel.spans(f"process {name}"), "the attempt's span")
        await dead_letter(app)

    attempt = otel.span(f"process {name}")
    assert (attempt.attributes or {})["error.type"] == "mersal.errors.DecodeError"
    dead_letters = otel.points("mersal.dead_letters")
    assert value(dead_letters, error__type="mersal.errors.DecodeError") == 1
