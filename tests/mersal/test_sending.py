"""Sending: headers, send/send_local/publish/defer/reply/request, and app.transaction()."""

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

import mersal
from mersal import (
    App,
    ConfigurationError,
    EncodeError,
    Header,
    MersalError,
    MessageContext,
    RequestTimeout,
    UnexpectedReply,
    Unroutable,
    Unsendable,
    message,
)
from mersal.testing import Harness
from mersal.transport.memory import MemoryTransport


@message("orders.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str
    amount: float


@dataclass
class ChargeCard:
    order_id: str
    amount: float


@dataclass
class OrderPlaced:
    order_id: str


@dataclass
class PaymentTaken:
    order_id: str


@dataclass
class StepA:
    n: int


@dataclass
class StepB:
    n: int


@dataclass
class StepC:
    n: int


@dataclass
class Remind:
    text: str


@dataclass
class GetQuote:
    item: str


@dataclass
class Quote:
    item: str
    price: float


async def test_what_arrives_carries_the_standard_headers() -> None:
    arrived: list[MessageContext] = []

    async def handle(message: PlaceOrder, context: MessageContext) -> None:
        arrived.append(context)

    api = App("api")
    api.route(PlaceOrder, "orders")
    orders = App("orders")
    orders.register(PlaceOrder, handle)
    async with Harness(api, orders) as bus:
        before = time.time()
        message_id = await api.send(PlaceOrder("o-1", 9.5))
        after = time.time()
        await bus.idle()

    [context] = arrived
    headers = context.headers
    assert headers[Header.MESSAGE_ID] == message_id
    assert str(uuid.UUID(message_id)) == message_id
    assert headers[Header.TYPE] == "orders.PlaceOrder.v1"
    assert headers[Header.CORRELATION_ID] == message_id
    assert Header.CAUSATION_ID not in headers
    assert headers[Header.REPLY_TO] == "api"
    assert headers[Header.SOURCE] == "api"
    assert headers[Header.CONTENT_TYPE] == "application/json"
    assert before - 0.001 <= float(headers[Header.SENT_AT]) <= after + 0.001
    assert context.message == PlaceOrder("o-1", 9.5)
    [recorded] = bus.sent
    assert recorded.address == "orders"
    assert recorded.headers == headers


async def test_every_message_gets_its_own_id() -> None:
    app = App("orders")
    app.route(PlaceOrder, "sink")
    app.register(Remind, noop)
    async with Harness(app) as bus:
        bus.broker.declare("sink")
        returned = [await app.send(PlaceOrder(f"o-{n}", n)) for n in range(10)]
        returned.append(await app.send_local(Remind("self")))
        returned.append(await app.publish(OrderPlaced("o-1")))
        await bus.idle()

    assert len(set(returned)) == 12
    recorded = [r.message_id for r in bus.sent + bus.published]
    assert sorted(recorded) == sorted(returned)
    assert bus.dead_lettered == []


async def test_message_name_is_the_type_header_and_decodes_on_the_other_side() -> None:
    got: list[PlaceOrder] = []

    async def handle(message: PlaceOrder) -> None:
        got.append(message)

    orders = App("orders")
    orders.register(PlaceOrder, handle)
    orders.route(PlaceOrder, "orders")
    async with Harness(orders) as bus:
        await orders.send(PlaceOrder("o-1", 2.5))
        await bus.idle()

    assert bus.sent[0].headers[Header.TYPE] == "orders.PlaceOrder.v1"
    assert got == [PlaceOrder("o-1", 2.5)]


async def test_correlation_id_follows_a_chain_and_causation_id_is_the_previous_message() -> None:
    seen: dict[str, dict[str, str]] = {}

    async def on_a(message: StepA, context: MessageContext) -> None:
        seen["a"] = dict(context.headers)
        await context.app.send_local(StepB(message.n))

    async def on_b(message: StepB, context: MessageContext) -> None:
        seen["b"] = dict(context.headers)
        await context.app.send_local(StepC(message.n))

    async def on_c(message: StepC, context: MessageContext) -> None:
        seen["c"] = dict(context.headers)

    app = App("chain")
    app.register(StepA, on_a)
    app.register(StepB, on_b)
    app.register(StepC, on_c)
    async with Harness(app) as bus:
        a_id = await app.send_local(StepA(1))
        await bus.idle()

    a, b, c = seen["a"], seen["b"], seen["c"]
    assert a[Header.MESSAGE_ID] == a_id
    assert len({a[Header.MESSAGE_ID], b[Header.MESSAGE_ID], c[Header.MESSAGE_ID]}) == 3
    assert a[Header.CORRELATION_ID] == b[Header.CORRELATION_ID] == c[Header.CORRELATION_ID] == a_id
    assert Header.CAUSATION_ID not in a
    assert b[Header.CAUSATION_ID] == a[Header.MESSAGE_ID]
    assert c[Header.CAUSATION_ID] == b[Header.MESSAGE_ID]
    assert [type(r.message) for r in bus.sent] == [StepA, StepB, StepC]


async def test_custom_headers_pass_through_and_send_local_goes_to_the_own_queue() -> None:
    got: list[dict[str, str]] = []

    async def handle(message: Remind, context: MessageContext) -> None:
        got.append(dict(context.headers))

    app = App("reminders")
    app.register(Remind, handle)
    async with Harness(app) as bus:
        message_id = await app.send_local(
            Remind("call mum"), headers={"tenant": "acme", "x-trace": "t-1"}
        )
        await bus.idle()

    [headers] = got
    assert headers["tenant"] == "acme"
    assert headers["x-trace"] == "t-1"
    assert headers[Header.MESSAGE_ID] == message_id
    assert bus.sent[0].address == "reminders"


async def test_partition_key_travels_as_a_header() -> None:
    got: list[str | None] = []

    async def handle(message: Remind, context: MessageContext) -> None:
        got.append(context.headers.get(Header.PARTITION_KEY))

    app = App("reminders")
    app.register(Remind, handle)
    async with Harness(app) as bus:
        await app.send_local(Remind("a"), partition_key="customer-7")
        await bus.idle()

    assert got == ["customer-7"]


@pytest.mark.parametrize("key", [b"customer-7", bytearray(b"customer-7"), 7.0, True, object()])
async def test_a_partition_key_that_is_not_text_is_refused_at_the_call(key: object) -> None:
    app = App("reminders")
    app.register(Remind, noop)
    async with Harness(app) as bus:
        with pytest.raises(Unsendable, match="a partition key is text") as refused:
            await app.send_local(Remind("a"), partition_key=key)  # type: ignore[arg-type]
        await bus.idle()

    assert bus.sent == []
    if isinstance(key, bytes | bytearray):
        assert "key.decode()" in str(refused.value)


async def test_an_int_or_uuid_partition_key_travels_as_its_text() -> None:
    got: list[str | None] = []

    async def handle(message: Remind, context: MessageContext) -> None:
        got.append(context.headers.get(Header.PARTITION_KEY))

    customer = uuid.UUID("12345678-1234-5678-1234-567812345678")
    app = App("reminders")
    app.register(Remind, handle)
    async with Harness(app) as bus:
        await app.send_local(Remind("a"), partition_key=17)  # type: ignore[arg-type]
        await app.send_local(Remind("b"), partition_key=customer)  # type: ignore[arg-type]
        await bus.idle()

    assert got == ["17", str(customer)]


async def test_two_apps_exchange_commands_and_events_and_only_subscribers_get_events() -> None:
    log: list[tuple[str, object]] = []

    async def place(message: PlaceOrder, context: MessageContext) -> None:
        log.append(("orders", message))
        await context.app.send(ChargeCard(message.order_id, message.amount))
        await context.app.publish(OrderPlaced(message.order_id))

    async def orders_saw_own_event(message: OrderPlaced) -> None:
        log.append(("orders", message))  # registered, but orders does not subscribe

    async def payment_taken(message: PaymentTaken) -> None:
        log.append(("orders", message))

    async def charge(message: ChargeCard, context: MessageContext) -> None:
        log.append(("billing", message))
        await context.app.publish(PaymentTaken(message.order_id))

    async def billing_saw_order(message: OrderPlaced) -> None:
        log.append(("billing", message))

    orders = App("orders")
    orders.route(PlaceOrder, "orders")
    orders.route(ChargeCard, "billing")
    orders.register(PlaceOrder, place)
    orders.register(OrderPlaced, orders_saw_own_event)
    orders.register(PaymentTaken, payment_taken)
    orders.subscribe(PaymentTaken)

    billing = App("billing")
    billing.register(ChargeCard, charge)
    billing.register(OrderPlaced, billing_saw_order)
    billing.subscribe(OrderPlaced)

    async with Harness(orders, billing) as bus:
        await orders.send(PlaceOrder("o-1", 10.0))
        await bus.idle()

    assert sorted(log, key=repr) == sorted(
        [
            ("orders", PlaceOrder("o-1", 10.0)),
            ("billing", ChargeCard("o-1", 10.0)),
            ("billing", OrderPlaced("o-1")),
            ("orders", PaymentTaken("o-1")),
        ],
        key=repr,
    )
    assert ("orders", OrderPlaced("o-1")) not in log
    assert bus.sent_of(ChargeCard) == [ChargeCard("o-1", 10.0)]
    assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]
    assert bus.published_of(PaymentTaken) == [PaymentTaken("o-1")]
    assert bus.dead_lettered == []


async def test_a_restart_without_a_subscription_no_longer_receives_its_events() -> None:
    url = f"memory://sending-{uuid.uuid4().hex}"

    async def ignore(event: object) -> None:
        return None

    def release(*events: type) -> App:
        app = App("shipping", transport=url)
        for event in events:
            app.register(event, ignore)
            app.subscribe(event)
        return app

    async with release(OrderPlaced, PaymentTaken):
        pass
    async with release(OrderPlaced) as second:
        pass
    async with App("sender", transport=url, consume=False) as sender:
        await sender.publish(PaymentTaken("o-2"))
        await sender.publish(OrderPlaced("o-2"))

    assert isinstance(second.transport, MemoryTransport)
    assert len(second.transport.broker.queues["shipping"]) == 1  # OrderPlaced only


async def test_defer_delivers_after_the_delay_and_is_recorded_as_deferred() -> None:
    arrived: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def handle(message: Remind) -> None:
        arrived.set_result(time.monotonic())

    app = App("reminders")
    app.register(Remind, handle)
    async with Harness(app) as bus:
        start, wall = time.monotonic(), time.time()
        message_id = await app.defer(0.2, Remind("later"))
        assert not arrived.done()
        async with asyncio.timeout(2):
            at = await arrived
        await bus.idle()

    assert at - start >= 0.15
    [deferred] = bus.deferred
    assert deferred.message == Remind("later")
    assert deferred.message_id == message_id
    assert deferred.address == "reminders"
    assert float(deferred.headers[Header.DELIVER_AT]) >= wall + 0.2 - 0.001
    assert bus.sent == []


async def test_defer_accepts_a_timedelta_and_uses_the_route() -> None:
    arrived: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def handle(message: Remind) -> None:
        arrived.set_result(time.monotonic())

    sender = App("scheduler")
    sender.route(Remind, "reminders")
    reminders = App("reminders")
    reminders.register(Remind, handle)
    async with Harness(sender, reminders) as bus:
        start = time.monotonic()
        await sender.defer(timedelta(milliseconds=150), Remind("later"))
        async with asyncio.timeout(2):
            at = await arrived

    assert at - start >= 0.1
    assert [d.address for d in bus.deferred] == ["reminders"]


async def test_request_returns_the_reply_object() -> None:
    async def quote(message: GetQuote, context: MessageContext) -> None:
        await context.app.reply(Quote(message.item, 4.25))

    shop = App("shop")
    shop.route(GetQuote, "pricing")
    pricing = App("pricing")
    pricing.register(GetQuote, quote)
    async with Harness(shop, pricing) as bus:
        reply = await shop.request(GetQuote("pen"), reply_type=Quote, timeout=2)
        await bus.idle()

    assert reply == Quote("pen", 4.25)
    [request] = [r for r in bus.sent if isinstance(r.message, GetQuote)]
    [sent_reply] = [r for r in bus.sent if isinstance(r.message, Quote)]
    assert request.address == "pricing"
    assert sent_reply.headers[Header.CAUSATION_ID] == request.message_id
    assert sent_reply.headers[Header.CORRELATION_ID] == request.message_id
    # The reply goes to the requesting instance's own reply queue, not its input queue.
    assert sent_reply.address == request.headers[Header.REPLY_TO]
    assert sent_reply.address.startswith("shop.")


async def test_request_without_a_reply_raises_request_timeout() -> None:
    handled = asyncio.Event()

    async def ignore(message: GetQuote) -> None:
        handled.set()

    shop = App("shop")
    shop.route(GetQuote, "pricing")
    pricing = App("pricing")
    pricing.register(GetQuote, ignore)
    async with Harness(shop, pricing):
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="GetQuote"):
            await shop.request(GetQuote("pen"), reply_type=Quote, timeout=0.2)
        elapsed = time.monotonic() - start

    assert handled.is_set()
    assert 0.15 <= elapsed < 1.0


async def test_reply_outside_a_handler_raises() -> None:
    app = App("shop")
    async with Harness(app):
        with pytest.raises(MersalError, match="inside a handler"):
            await app.reply(Quote("pen", 1.0))


async def test_transaction_block_sends_on_a_clean_exit_only() -> None:
    app = App("orders")
    app.route(PlaceOrder, "sink")
    async with Harness(app) as bus:
        bus.broker.declare("sink")
        async with app.transaction():
            await app.send(PlaceOrder("o-1", 1.0))
            await app.publish(OrderPlaced("o-1"))
            await app.send(PlaceOrder("o-2", 2.0))
            assert bus.sent == []
            assert bus.published == []
        await bus.idle()
        assert bus.sent_of(PlaceOrder) == [PlaceOrder("o-1", 1.0), PlaceOrder("o-2", 2.0)]
        assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]

        with pytest.raises(RuntimeError, match="validation failed"):
            async with app.transaction():
                await app.send(PlaceOrder("o-3", 3.0))
                await app.publish(OrderPlaced("o-3"))
                raise RuntimeError("validation failed")
        await bus.idle()

    assert bus.sent_of(PlaceOrder) == [PlaceOrder("o-1", 1.0), PlaceOrder("o-2", 2.0)]
    assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]
    assert len(bus.broker.queues["sink"]) == 2


async def test_concurrent_requests_each_get_their_own_reply() -> None:
    async def quote(message: GetQuote, context: MessageContext) -> None:
        await asyncio.sleep(0.002 * (5 - len(message.item)))  # replies finish out of order
        await context.app.reply(Quote(message.item, float(len(message.item))))

    shop = App("shop")
    shop.route(GetQuote, "pricing")
    pricing = App("pricing")
    pricing.register(GetQuote, quote)
    items = ["a", "bb", "ccc", "dddd", "eeeee"]
    async with Harness(shop, pricing):
        replies = await asyncio.gather(
            *(shop.request(GetQuote(item), reply_type=Quote, timeout=2) for item in items)
        )

    assert replies == [Quote(item, float(len(item))) for item in items]


async def test_a_reply_to_a_plain_send_goes_to_the_senders_input_queue() -> None:
    got: list[tuple[Quote, str]] = []

    async def quote(message: GetQuote, context: MessageContext) -> None:
        await context.app.reply(Quote(message.item, 1.0))

    async def on_quote(message: Quote, context: MessageContext) -> None:
        got.append((message, context.headers[Header.CAUSATION_ID]))

    shop = App("shop")
    shop.route(GetQuote, "pricing")
    shop.register(Quote, on_quote)
    pricing = App("pricing")
    pricing.register(GetQuote, quote)
    async with Harness(shop, pricing) as bus:
        request_id = await shop.send(GetQuote("pen"))
        await bus.idle()

    assert got == [(Quote("pen", 1.0), request_id)]
    [reply] = [r for r in bus.sent if isinstance(r.message, Quote)]
    assert reply.address == "shop"


async def test_a_route_for_a_base_class_covers_its_subclasses() -> None:
    @dataclass
    class Urgent(Remind):
        level: int

    got: list[Remind] = []

    async def handle(message: Remind) -> None:
        got.append(message)

    sender = App("sender")
    sender.route(Remind, "reminders")
    reminders = App("reminders")
    reminders.register(Remind, handle)
    async with Harness(sender, reminders) as bus:
        await sender.send(Urgent("now", 3))
        await bus.idle()

    assert got == [Urgent("now", 3)]
    assert [r.address for r in bus.sent] == ["reminders"]


async def test_send_does_not_change_the_callers_headers() -> None:
    app = App("reminders")
    app.register(Remind, noop)
    headers = {"tenant": "acme"}
    async with Harness(app) as bus:
        await app.send_local(Remind("a"), headers=headers, partition_key="k")
        await app.defer(0.01, Remind("b"), headers=headers)
        await bus.idle()

    assert headers == {"tenant": "acme"}
    assert all(r.headers["tenant"] == "acme" for r in bus.sent + bus.deferred)


async def test_sending_to_a_queue_that_does_not_exist_raises_unroutable() -> None:
    app = App("orders")
    app.route(PlaceOrder, "nobody-listens")
    async with Harness(app):
        with pytest.raises(Unroutable, match="nobody-listens"):
            await app.send(PlaceOrder("o-1", 1.0))
    assert issubclass(Unroutable, MersalError)


async def noop(message: object) -> None:
    pass


@pytest.mark.parametrize("delay", [float("inf"), float("nan")])
async def test_defer_refuses_a_delay_that_is_not_finite(delay: float) -> None:
    app = App("clock")
    app.register(Remind, _ignore)
    async with Harness(app) as bus:
        with pytest.raises(MersalError, match="finite"):
            await app.defer(delay, Remind("r-1"))
        await bus.idle()
    assert bus.deferred == []


async def _ignore(message: Remind) -> None:
    return None


async def test_a_reply_of_another_type_than_asked_for_raises_unexpected_reply() -> None:
    async def quote(message: GetQuote, context: MessageContext) -> None:
        await context.app.reply(GetQuote(f"not a quote for {message.item}"))

    shop = App("shop")
    shop.route(GetQuote, "pricing")
    pricing = App("pricing")
    pricing.register(GetQuote, quote)
    async with Harness(shop, pricing):
        with pytest.raises(UnexpectedReply, match="is a GetQuote, not the Quote asked for"):
            await shop.request(GetQuote("pen"), reply_type=Quote, timeout=2)


# A message a receiver could not decode is refused at the call.

WRONG_AMOUNT = (
    "cannot send PlaceOrder: field amount holds a str ('9.5') where PlaceOrder declares float; "
    "convert the value before sending"
)


async def test_a_value_of_the_wrong_type_is_refused_at_the_call_and_nothing_is_sent() -> None:
    app = App("orders")
    app.route(PlaceOrder, "orders")
    app.register(PlaceOrder, noop)
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as sent:
            await app.send(PlaceOrder("o-1", "9.5"))  # type: ignore[arg-type]
        with pytest.raises(EncodeError) as published:
            await app.publish(PlaceOrder("o-1", "9.5"))  # type: ignore[arg-type]
        with pytest.raises(EncodeError) as deferred:
            await app.defer(60, PlaceOrder("o-1", "9.5"))  # type: ignore[arg-type]
        await bus.idle()
        assert bus.sent == bus.published == bus.deferred == bus.dead_lettered == []
    assert str(sent.value) == str(published.value) == str(deferred.value) == WRONG_AMOUNT


async def test_a_value_of_the_wrong_type_is_refused_inside_a_transaction_not_at_commit() -> None:
    app = App("orders")
    app.route(PlaceOrder, "orders")
    app.register(PlaceOrder, noop)
    async with Harness(app) as bus:
        async with app.transaction():
            await app.send(PlaceOrder("o-1", 1))
            with pytest.raises(EncodeError) as raised:
                await app.send(PlaceOrder("o-2", "9.5"))  # type: ignore[arg-type]
            await app.send(PlaceOrder("o-3", 3.5))
        await bus.idle()
    assert str(raised.value) == WRONG_AMOUNT
    assert bus.sent_of(PlaceOrder) == [PlaceOrder("o-1", 1), PlaceOrder("o-3", 3.5)]


async def test_a_handler_sending_a_value_of_the_wrong_type_gets_the_error_at_its_call() -> None:
    refused: list[str] = []

    async def forward(message: Remind) -> None:
        try:
            await app.reply(ChargeCard("o-1", "9.5"))  # type: ignore[arg-type]
        except EncodeError as error:
            refused.append(str(error))
        await app.send(ChargeCard("o-1", 9.5))

    app = App("orders")
    app.route(ChargeCard, "orders")
    app.register(Remind, forward)
    app.register(ChargeCard, noop)
    async with Harness(app) as bus:
        await app.send_local(Remind("go"))
        await bus.idle()
        assert bus.sent_of(ChargeCard) == [ChargeCard("o-1", 9.5)]
        assert bus.dead_lettered == []
    assert refused == [
        "cannot send ChargeCard: field amount holds a str ('9.5') where ChargeCard declares "
        "float; convert the value before sending"
    ]


NOT_A_MESSAGE = (
    "cannot send a dict: a message is a dataclass, a pydantic model, a msgspec Struct or an "
    "attrs class; define one (@dataclass class ...) and send an instance"
)


async def test_a_dict_is_refused_as_not_a_message_before_any_routing_advice() -> None:
    app = App("orders")
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as sent:
            await app.send({"order_id": "o-1"})
        with pytest.raises(EncodeError) as published:
            await app.publish({"order_id": "o-1"})
        with pytest.raises(EncodeError) as requested:
            await app.request({"order_id": "o-1"})
        with pytest.raises(EncodeError) as local:
            await app.send_local(["o-1"])
        assert bus.sent == bus.published == []
    assert str(sent.value) == str(published.value) == str(requested.value) == NOT_A_MESSAGE
    assert str(local.value) == NOT_A_MESSAGE.replace("a dict", "a list")


async def test_sending_a_message_class_instead_of_an_instance_says_to_send_an_instance() -> None:
    app = App("orders")
    app.route(PlaceOrder, "orders")
    async with Harness(app):
        with pytest.raises(EncodeError) as raised:
            await app.send(PlaceOrder)
    assert str(raised.value) == (
        "cannot send the class PlaceOrder itself: send an instance, PlaceOrder(...)"
    )


async def test_a_codec_without_validation_sends_what_it_encodes() -> None:
    class TextCodec:
        content_type = "text/plain"

        def encode(self, message: object) -> bytes:
            return str(message).encode()

        def decode(self, body: bytes, cls: type) -> Any:
            return cls(body.decode())

    got: list[str] = []

    async def handle(message: str) -> None:
        got.append(message)

    app = App("notes", codec=TextCodec())
    app.route(str, "notes")
    app.register(str, handle)
    async with Harness(app) as bus:
        await app.send("hello")
        await bus.idle()
    assert got == ["hello"]


class Money:
    """A value msgspec cannot encode."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


@dataclass
class Line:
    sku: str
    price: object


@dataclass
class Invoice:
    number: int
    lines: list[Line]


# Messages that cannot be encoded: refused at the call, nothing sent or buffered.


async def test_a_field_that_cannot_be_encoded_raises_encode_error_and_nothing_is_sent() -> None:
    app = App("billing")
    app.route(Invoice, "billing")
    app.register(Invoice, noop)
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.send(Invoice(7, [Line("pen", 1.5), Line("ink", Money(250))]))
        await bus.idle()
        assert bus.sent == []
    assert str(raised.value) == (
        "cannot encode Invoice as JSON: field lines[1].price holds a Money; give the field a "
        "type JSON can carry (str, int, float, bool, None, list, dict with str keys, datetime, "
        "UUID, Decimal, enum, or a dataclass, pydantic model, msgspec Struct or attrs class) or "
        "convert the value before sending"
    )
    assert issubclass(EncodeError, MersalError)
    assert mersal.EncodeError is EncodeError


async def test_publishing_an_object_that_is_not_a_message_says_what_a_message_is() -> None:
    app = App("billing")
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.publish(Money(250))
        assert bus.published == []
    assert str(raised.value) == (
        "cannot send Money: a message is a dataclass, a pydantic model, a msgspec Struct or an "
        "attrs class; make Money one (e.g. decorate it with @dataclass)"
    )


async def test_a_message_that_cannot_be_encoded_is_not_buffered_in_its_transaction() -> None:
    app = App("billing")
    app.route(Invoice, "billing")
    app.register(Invoice, noop)
    async with Harness(app) as bus:
        async with app.transaction():
            await app.send(Invoice(1, []))
            with pytest.raises(EncodeError, match="field lines"):
                await app.send(Invoice(2, [Line("ink", Money(250))]))
            await app.send(Invoice(3, []))
        await bus.idle()
    assert bus.sent_of(Invoice) == [Invoice(1, []), Invoice(3, [])]


@pytest.mark.parametrize("amount", [math.inf, -math.inf, math.nan])
async def test_a_float_json_cannot_carry_raises_encode_error_instead_of_arriving_as_null(
    amount: float,
) -> None:
    app = App("billing")
    app.route(Line, "billing")
    app.register(Line, noop)
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.send(Line("pen", amount))
        await app.send(Line("ink", 2.5))
        await bus.idle()
        assert bus.sent_of(Line) == [Line("ink", 2.5)]
        assert bus.dead_lettered == []
    assert str(raised.value) == (
        f"cannot encode Line as JSON: field price holds {amount!r}, which JSON cannot carry (it "
        "would arrive as null): send a finite number"
    )


@dataclass
class Unrouted:
    n: int


async def test_sending_an_unrouted_type_says_to_call_app_route() -> None:
    app = App("a")
    async with Harness(app):
        with pytest.raises(ConfigurationError) as raised:
            await app.send(Unrouted(1))
    assert "Unrouted" in str(raised.value)
    assert "app.route(Unrouted" in str(raised.value)


@dataclass
class Later:
    n: int


@pytest.mark.parametrize("delay", ["10", None, True])
async def test_a_delay_that_is_not_seconds_or_a_timedelta_is_refused(
    delay: object, memory_url: str
) -> None:
    app = App("deferring", transport=memory_url)
    async with app:
        with pytest.raises(Unsendable) as refused:
            await app.defer(delay, Later(1), to_self=True)  # type: ignore[arg-type]

    assert str(refused.value) == (
        f"defer({delay!r}, ...) needs a delay in seconds (a number) or a timedelta"
    )
