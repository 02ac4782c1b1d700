"""OpenTelemetry spans and metrics for an app, after the messaging semantic conventions.

`instrument(app)` puts steps into `app.incoming` and `app.outgoing` and makes itself the app's
observer (`mersal.observer`), to which the core reports what no step sees: each delivery and
the outcome it came to, the publishes at commit and by the outbox relay, the inbox's duplicates
and the outbox backlog. OpenTelemetry (the `otel` extra) is imported here only; the core never
imports this module.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from mersal.app import App
from mersal.context import MessageContext, OutgoingContext
from mersal.distribution import NAME
from mersal.errors import ConfigurationError, Duplicate, MersalError
from mersal.messages import Header
from mersal.pipeline import Next
from mersal.retry import attempts_made
from mersal.settle import Outcome, Verdict, error_text, error_type
from mersal.transport import Delivery, Outgoing, Transport

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.propagate import get_global_textmap
except ImportError as missing:  # without the extra: instrument() says what to install
    OPENTELEMETRY_MISSING: ImportError | None = missing
else:
    OPENTELEMETRY_MISSING = None

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import (
        CallbackOptions,
        Counter,
        Histogram,
        Meter,
        MeterProvider,
        Observation,
    )
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Span, SpanContext

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
"""The semantic conventions the spans and metrics follow."""

RABBITMQ_EVENTS_EXCHANGE = "mersal.events"
"""The exchange `mersal_rabbitmq` publishes events on (a publish's destination names it)."""

REPLY_DESTINATION = "(reply)"
"""The destination metrics and span names give every reply: reply addresses are unbounded."""

SYSTEMS = {"amqp": "rabbitmq", "amqps": "rabbitmq"}
"""`messaging.system` by transport URL scheme; other schemes name themselves (`memory`)."""

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
"""The histogram buckets the conventions advise for messaging durations, in seconds."""

SYSTEM = "messaging.system"
OPERATION_NAME = "messaging.operation.name"
OPERATION_TYPE = "messaging.operation.type"
DESTINATION = "messaging.destination.name"
TEMPORARY = "messaging.destination.temporary"
MESSAGE_ID = "messaging.message.id"
CONVERSATION_ID = "messaging.message.conversation_id"
BODY_SIZE = "messaging.message.body.size"
ROUTING_KEY = "messaging.rabbitmq.destination.routing_key"
DELIVERY_TAG = "messaging.rabbitmq.message.delivery_tag"
ERROR_TYPE = "error.type"
MESSAGE_TYPE = "mersal.message.type"
ATTEMPT = "mersal.attempt"
DUPLICATE = "mersal.inbox.duplicate"
RETRY_KIND = "mersal.retry.kind"
REPLY = "mersal.reply"
APP = "mersal.app"

CREATE = "create"
SEND = "send"
PROCESS = "process"

STEP = "telemetry"
"""The outgoing step tracing sends, and the first incoming step, tracing each attempt."""


def instrument(
    app: App,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> None:
    """Trace and measure `app` with OpenTelemetry (None: the global providers), before it starts."""
    if OPENTELEMETRY_MISSING is not None:
        raise MersalError(
            "mersal.telemetry needs OpenTelemetry, which is not installed: "
            "pip install 'mersal-bus[otel]'"
        ) from OPENTELEMETRY_MISSING
    _check_instrumentable(app)
    telemetry = OpenTelemetry(app, tracer_provider, meter_provider)
    app.outgoing.insert_before("serialize", STEP, telemetry.produce)
    app.incoming.insert_before(app.incoming.names[0], STEP, telemetry.process)
    app.observe(telemetry)


def _check_instrumentable(app: App) -> None:
    """Refuse an app that is running, instrumented already, or lacks a step to anchor to."""
    if app.running:
        raise ConfigurationError(
            f"instrument(app) before app {app.name!r} starts: its pipelines are fixed once it "
            "runs; call instrument(app) right after building the app"
        )
    if isinstance(app.observer, OpenTelemetry):
        raise ConfigurationError(f"app {app.name!r} is instrumented already: call instrument once")
    if app.observer is not None:
        raise ConfigurationError(
            f"app {app.name!r} has an observer already ({type(app.observer).__qualname__}): "
            "an app reports to one observer; instrument an app without one"
        )
    if not app.incoming.names:
        raise ConfigurationError(f"app {app.name!r} has no incoming steps to trace")
    if "serialize" not in app.outgoing.names:
        raise ConfigurationError(
            "instrument(app) traces sends just before 'serialize', which app.outgoing no longer "
            f"has (its steps: {app.outgoing.names}): keep a step named 'serialize'"
        )
    if STEP in {*app.incoming.names, *app.outgoing.names}:
        raise ConfigurationError(
            f"app {app.name!r} has a step named {STEP!r}, a name instrument(app) needs: "
            "rename yours"
        )


@dataclass(frozen=True)
class Instruments:
    """The metric instruments an instrumented app records to."""

    operation_duration: Histogram
    sent: Counter
    consumed: Counter
    process_duration: Histogram
    retries: Counter
    dead_letters: Counter
    duplicates: Counter

    @classmethod
    def on(cls, meter: Meter) -> Instruments:
        """The instruments, made on `meter` (a meter gives the same ones for the same names)."""
        return cls(
            meter.create_histogram(
                "messaging.client.operation.duration",
                unit="s",
                description="Duration of messaging operation initiated by a producer or consumer "
                "client.",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            ),
            meter.create_counter(
                "messaging.client.sent.messages",
                unit="{message}",
                description="Number of messages producer attempted to send to the broker.",
            ),
            meter.create_counter(
                "messaging.client.consumed.messages",
                unit="{message}",
                description="Number of messages that were delivered to the application.",
            ),
            meter.create_histogram(
                "messaging.process.duration",
                unit="s",
                description="Duration of processing operation.",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            ),
            meter.create_counter(
                "mersal.retries",
                unit="{retry}",
                description="Attempts at a message that failed and were tried again, at once "
                "(immediate) or through the broker (delayed).",
            ),
            meter.create_counter(
                "mersal.dead_letters",
                unit="{message}",
                description="Messages moved to the error queue.",
            ),
            meter.create_counter(
                "mersal.inbox.duplicates",
                unit="{message}",
                description="Messages the inbox had handled already, acknowledged unhandled.",
            ),
        )


class OutboxGauges:
    """The outbox backlog gauges of one meter provider, reporting every app instrumented on it.

    A meter keeps the first callback of an observable instrument name, so the apps sharing a
    provider share one callback; it reads what each app's relay measured last.
    """

    _by_provider: weakref.WeakKeyDictionary[MeterProvider, OutboxGauges] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, meter: Meter) -> None:
        self.apps: weakref.WeakSet[OpenTelemetry] = weakref.WeakSet()
        meter.create_observable_gauge(
            "mersal.outbox.pending",
            callbacks=[self._pending],
            unit="{message}",
            description="Committed messages waiting in the outbox to be sent (parked ones not "
            "counted), as the relay last counted them.",
        )
        meter.create_observable_gauge(
            "mersal.outbox.oldest_age",
            callbacks=[self._oldest_age],
            unit="s",
            description="How long the oldest message waiting in the outbox has waited, as the "
            "relay last measured it.",
        )

    @classmethod
    def track(cls, provider: MeterProvider, meter: Meter, telemetry: OpenTelemetry) -> None:
        """Report `telemetry`'s backlog through the gauges of `provider` (made on `meter`)."""
        gauges = cls._by_provider.get(provider)
        if gauges is None:
            gauges = cls._by_provider[provider] = cls(meter)
        gauges.apps.add(telemetry)

    def _pending(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            metrics.Observation(backlog[0], {APP: telemetry.app.name})
            for telemetry, backlog in self._backlogs()
        ]

    def _oldest_age(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            metrics.Observation(backlog[1], {APP: telemetry.app.name})
            for telemetry, backlog in self._backlogs()
        ]

    def _backlogs(self) -> list[tuple[OpenTelemetry, tuple[int, float]]]:
        return [(t, t.backlog) for t in list(self.apps) if t.backlog is not None]


class OpenTelemetry:
    """An app's instrumentation: its pipeline steps, and the observer the core reports to."""

    def __init__(
        self,
        app: App,
        tracer_provider: trace.TracerProvider | None,
        meter_provider: metrics.MeterProvider | None,
    ) -> None:
        ours = _version()
        self.app = app
        self.tracer = trace.get_tracer("mersal", ours, tracer_provider, schema_url=SCHEMA_URL)
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        meter = provider.get_meter("mersal", ours, schema_url=SCHEMA_URL)
        self.instruments = Instruments.on(meter)
        self.backlog: tuple[int, float] | None = None
        """The outbox's pending rows and the oldest one's age, as the relay last measured them."""
        self._transport: Transport | None = None
        self._system = ""
        OutboxGauges.track(provider, meter, self)

    @property
    def propagator(self) -> TextMapPropagator:
        """The global propagator, which writes and reads the trace context in headers."""
        return get_global_textmap()

    # What the core reports.

    def received(self, context: MessageContext) -> None:
        """Count the delivery."""
        self.instruments.consumed.add(1, self._consumer_attributes(context))

    def decided(self, context: MessageContext, outcome: Outcome) -> None:
        """Count the immediate retries, and the delayed retry or dead letter it came to."""
        instruments = self.instruments
        attributes = self._consumer_attributes(context)
        immediate = context.attempt - attempts_made(context.envelope) - 1
        if immediate > 0:
            instruments.retries.add(immediate, {**attributes, RETRY_KIND: "immediate"})
        if outcome.verdict is Verdict.RETRY_LATER:
            instruments.retries.add(1, {**attributes, RETRY_KIND: "delayed"})
        elif outcome.verdict is Verdict.DEAD_LETTER:
            failure = outcome.failure.type_name if outcome.failure else "_OTHER"
            instruments.dead_letters.add(1, {**attributes, ERROR_TYPE: failure})

    async def send_each(
        self, transport: Transport, messages: Sequence[Outgoing], *, detached: bool
    ) -> list[Exception | None]:
        """`transport.send_each(messages)` with a send span each: in a trace of its own when
        `detached` (the outbox relay), else in the current one (a commit without an outbox)."""
        parent = otel_context.Context() if detached else None
        return await self._send_each(transport, messages, parent)

    def skipped_duplicate(self, context: MessageContext) -> None:
        """Count the duplicate (its attempt's span is marked by `process`)."""
        self.instruments.duplicates.add(1, self._consumer_attributes(context))

    def outbox_measured(self, pending: int, oldest_age: float) -> None:
        """Keep the measurement for the outbox gauges."""
        self.backlog = (pending, oldest_age)

    # The outgoing step.

    async def produce(self, context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        """Trace a send: a create span in a transaction, else a send span around the publish."""
        if context.transaction is None:
            await self._send_now(context, next)
            return
        await self._create(context, next)

    async def _create(self, context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        """Open the message's create span and carry its context in the headers."""
        if self._carries_context(context.headers):  # the caller's own creation context
            await next(context)
            return
        attributes = self._producer_attributes(
            CREATE, context.address, context.publish, context.headers
        )
        span = self.tracer.start_span(
            _span_name(attributes), kind=trace.SpanKind.PRODUCER, attributes=attributes
        )
        try:
            self.propagator.inject(context.headers, trace.set_span_in_context(span))
            await next(context)
        except BaseException as error:
            _fail(span, error)
            raise
        finally:
            span.end()

    async def _send_now(self, context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        """Send outside any transaction: the send span's context is the creation context."""
        carried = self._carries_context(context.headers)
        attributes = self._producer_attributes(
            SEND, context.address, context.publish, context.headers
        )
        kind = trace.SpanKind.CLIENT if carried else trace.SpanKind.PRODUCER
        links = self._links(context.headers) if carried else ()
        span = self.tracer.start_span(
            _span_name(attributes), kind=kind, attributes=attributes, links=links
        )
        started = time.perf_counter()
        failure: BaseException | None = None
        try:
            if not carried:
                self.propagator.inject(context.headers, trace.set_span_in_context(span))
            await next(context)
            span.set_attribute(BODY_SIZE, len(context.envelope.body))
        except BaseException as error:
            failure = error
            raise
        finally:
            self._end_send(span, attributes, failure, time.perf_counter() - started)

    async def _send_each(
        self, transport: Transport, messages: Sequence[Outgoing], parent: Context | None
    ) -> list[Exception | None]:
        """Send with a span per message, linked to its creation context (under `parent`)."""
        system = system_of(transport)
        spans = [self._start_send(system, outgoing, parent) for outgoing in messages]
        started = time.perf_counter()
        try:
            results = await transport.send_each(messages)
        except BaseException as error:
            elapsed = time.perf_counter() - started
            for span, attributes in spans:
                self._end_send(span, attributes, error, elapsed)
            raise
        elapsed = time.perf_counter() - started
        for (span, attributes), result in zip(spans, results, strict=True):
            self._end_send(span, attributes, result, elapsed)
        return results

    def _start_send(
        self, system: str, outgoing: Outgoing, parent: Context | None
    ) -> tuple[Span, dict[str, str | int]]:
        envelope = outgoing.envelope
        attributes = _producer_attributes(
            system, SEND, outgoing.address, outgoing.publish, envelope.headers
        )
        attributes[BODY_SIZE] = len(envelope.body)
        span = self.tracer.start_span(
            _span_name(attributes),
            parent,
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            links=self._links(envelope.headers),
        )
        return span, attributes

    def _end_send(
        self,
        span: Span,
        attributes: Mapping[str, str | int],
        failure: BaseException | None,
        seconds: float,
    ) -> None:
        """End a send span and count the send, as sent or as failed."""
        measured = _measured(attributes)
        if failure is not None:
            measured[ERROR_TYPE] = _fail(span, failure)
        span.end()
        self.instruments.sent.add(1, measured)
        measured[OPERATION_TYPE] = SEND
        self.instruments.operation_duration.record(seconds, measured)

    # The incoming step.

    async def process(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Trace one attempt as a process span, current while the handlers run.

        A first attempt is a child of the message's creation context; a retry or a deferred
        message starts a trace of its own. Both link to the creation context.
        """
        parent, links = self._consumer_parent(context)
        attributes = self._process_attributes(context)
        span = self.tracer.start_span(
            _span_name(attributes),
            parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        measured = _measured(attributes)
        started = time.perf_counter()
        try:
            await next(context)
        except Duplicate as duplicate:
            if duplicate.message_id != context.message_id:
                measured[ERROR_TYPE] = _fail(span, duplicate)
            else:
                span.set_attribute(DUPLICATE, True)
            raise
        except BaseException as error:
            measured[ERROR_TYPE] = _fail(span, error)
            raise
        finally:
            otel_context.detach(token)
            span.end()
            self.instruments.process_duration.record(time.perf_counter() - started, measured)

    def _consumer_parent(self, context: MessageContext) -> tuple[Context, Sequence[trace.Link]]:
        """The parent of an attempt's span, and its links."""
        headers = context.headers
        extracted, creation = self._extract(headers)
        if creation is None:
            return otel_context.Context(), ()
        first = context.attempt == 1 and Header.DELIVER_AT not in headers
        return (extracted if first else otel_context.Context()), (trace.Link(creation),)

    # Attributes.

    def _producer_attributes(
        self, operation: str, address: str, publish: bool, headers: Mapping[str, str]
    ) -> dict[str, str | int]:
        return _producer_attributes(self._current_system(), operation, address, publish, headers)

    def _consumer_attributes(self, context: MessageContext) -> dict[str, str]:
        """What a delivery's metrics are recorded with."""
        system = self._current_system()
        return {
            SYSTEM: system,
            OPERATION_NAME: PROCESS,
            DESTINATION: consumer_destination(system, context.delivery),
        }

    def _process_attributes(self, context: MessageContext) -> dict[str, str | int]:
        attributes: dict[str, str | int] = {
            **self._consumer_attributes(context),
            OPERATION_TYPE: PROCESS,
            BODY_SIZE: len(context.envelope.body),
            ATTEMPT: context.attempt,
        }
        _add_message_attributes(attributes, context.headers)
        if attributes[SYSTEM] == "rabbitmq":
            _add_delivery_attributes(attributes, context.delivery)
        return attributes

    def _current_system(self) -> str:
        """`messaging.system` of the app's transport (which may change until it starts)."""
        transport = self.app.transport
        if transport is not self._transport:
            self._transport, self._system = transport, system_of(transport)
        return self._system

    # Context propagation.

    def _carries_context(self, headers: Mapping[str, str]) -> bool:
        """Whether the sender put a trace context in the headers itself."""
        return not self.propagator.fields.isdisjoint(headers)

    def _links(self, headers: Mapping[str, str]) -> Sequence[trace.Link]:
        """A link to the creation context the headers carry, if any."""
        creation = self._extract(headers)[1]
        return (trace.Link(creation),) if creation is not None else ()

    def _extract(self, headers: Mapping[str, str]) -> tuple[Context, SpanContext | None]:
        """The context the headers carry, and the creation context in it (None if none)."""
        extracted = self.propagator.extract(headers)
        creation = trace.get_current_span(extracted).get_span_context()
        return extracted, creation if creation.is_valid else None


def system_of(transport: Transport) -> str:
    """`messaging.system` for a transport: `rabbitmq`, else its URL scheme."""
    scheme, separator, _ = str(transport.address).partition("://")
    if not separator:
        return "unknown"
    scheme = scheme.lower()
    return SYSTEMS.get(scheme, scheme)


def producer_destination(system: str, address: str, publish: bool) -> str:
    """The destination a send names: its queue, or its topic (`exchange:topic` on RabbitMQ)."""
    if publish and system == "rabbitmq":
        return f"{RABBITMQ_EVENTS_EXCHANGE}:{address}"
    return address


def consumer_destination(system: str, delivery: Delivery) -> str:
    """The destination a delivery names: its queue (`exchange:routing key:queue` on RabbitMQ).

    Empty parts are left out, and a routing key that names the queue itself too; so is one
    from another exchange than the events exchange (a partition key, say: it has no bound).
    """
    queue = delivery.queue
    if system != "rabbitmq":
        return queue
    exchange = getattr(delivery, "exchange", "") or ""
    routing_key = getattr(delivery, "routing_key", "") or ""
    if routing_key == queue or exchange != RABBITMQ_EVENTS_EXCHANGE:
        routing_key = ""
    return ":".join(part for part in (exchange, routing_key, queue) if part)


def _producer_attributes(
    system: str, operation: str, address: str, publish: bool, headers: Mapping[str, str]
) -> dict[str, str | int]:
    attributes: dict[str, str | int] = {
        SYSTEM: system,
        OPERATION_NAME: operation,
        OPERATION_TYPE: operation,
        DESTINATION: producer_destination(system, address, publish),
    }
    _add_message_attributes(attributes, headers)
    if system == "rabbitmq":
        attributes[ROUTING_KEY] = address
    if headers.get(Header.REPLY) == "true":
        attributes[REPLY] = True
        if headers.get(Header.TEMPORARY_REPLY_TO) == "true":
            attributes[TEMPORARY] = True
    return attributes


def _named_destination(attributes: Mapping[str, str | int]) -> str | int:
    """The destination a span name and the metrics give: `(reply)` for any reply."""
    return REPLY_DESTINATION if attributes.get(REPLY) else attributes[DESTINATION]


def _measured(attributes: Mapping[str, str | int]) -> dict[str, str | int]:
    """The attributes a span's metrics are recorded with (a bounded set of values each)."""
    return {
        SYSTEM: attributes[SYSTEM],
        OPERATION_NAME: attributes[OPERATION_NAME],
        DESTINATION: _named_destination(attributes),
    }


def _add_message_attributes(attributes: dict[str, str | int], headers: Mapping[str, str]) -> None:
    for attribute, header in (
        (MESSAGE_ID, Header.MESSAGE_ID),
        (CONVERSATION_ID, Header.CORRELATION_ID),
        (MESSAGE_TYPE, Header.TYPE),
    ):
        value = headers.get(header)
        if value:
            attributes[attribute] = value


def _add_delivery_attributes(attributes: dict[str, str | int], delivery: Delivery) -> None:
    routing_key = getattr(delivery, "routing_key", None)
    if routing_key:
        attributes[ROUTING_KEY] = routing_key
    tag = getattr(delivery, "delivery_tag", None)
    if isinstance(tag, int):
        attributes[DELIVERY_TAG] = tag


def _span_name(attributes: Mapping[str, str | int]) -> str:
    """`{operation} {destination}`, as the conventions name messaging spans."""
    return f"{attributes[OPERATION_NAME]} {_named_destination(attributes)}"


def _fail(span: Span, error: BaseException) -> str:
    """Mark `span` as failed by `error`; its `error.type`."""
    kind = error_type(error)
    span.set_attribute(ERROR_TYPE, kind)
    span.record_exception(error)
    span.set_status(trace.Status(trace.StatusCode.ERROR, error_text(error)[:1024]))
    return kind


def _version() -> str | None:
    try:
        return version(NAME)
    except PackageNotFoundError:
        return None
