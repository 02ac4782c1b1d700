"""Saga classes read and checked at register_saga (no servers): the spec, and every refusal.

Every ConfigurationError must say what to change, so each test checks the fix is named.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Any, Union

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, ConfigurationError, MersalError
from mersal.errors import DecodeError
from mersal.messages import Header
from mersal.sagas import (
    CORRELATION_LENGTH,
    InvalidCorrelation,
    Saga,
    SagaSpec,
    correlation_key,
    saga_spec,
)
from mersal.serialization import JsonCodec


@dataclass
class OrderPlaced:
    order_id: str


@dataclass
class PaymentReceived:
    order_id: str


@dataclass
class StockReserved:
    order_ref: str


@dataclass
class OrderCancelled:
    order_id: str


@dataclass
class PaymentOverdue:
    order_id: str


@dataclass
class Reminder:
    n: int


@dataclass
class Fulfilment:
    order_id: str = ""
    paid: bool = False
    reserved: bool = False
    notes: list[str] = field(default_factory=list)


class NotAMessage:
    """A plain class: no codec carries it."""


class OrderFulfilment(Saga[Fulfilment], name="shop.OrderFulfilment"):
    started_by = (OrderPlaced,)
    correlation = {
        OrderPlaced: "order_id",
        PaymentReceived: "order_id",
        StockReserved: lambda event: event.order_ref,
        OrderCancelled: "order_id",
    }

    async def placed(self, event: OrderPlaced) -> None:
        self.data.order_id = event.order_id

    async def settled(self, event: Union[PaymentReceived, OrderCancelled]) -> None:  # noqa: UP007
        self.data.paid = isinstance(event, PaymentReceived)

    async def reserved(self, event: StockReserved) -> None:
        self.data.reserved = True

    async def timed_out(self, timeout: PaymentOverdue | Reminder) -> None:
        self.mark_complete()

    async def _helper(self, anything: int, more: int) -> None:
        """Private: not a handling method, whatever its signature."""

    def sync_method(self, event: OrderPlaced, extra: int) -> None:
        """Not async: not a handling method."""


class Unnamed(Saga[Fulfilment]):
    started_by = (OrderPlaced,)
    correlation = {OrderPlaced: "order_id"}

    async def placed(self, event: OrderPlaced) -> None:
        pass


def spec_of(saga: object, *, pessimistic: bool = False) -> SagaSpec:
    return saga_spec(saga, JsonCodec(), pessimistic=pessimistic)


def refusal(saga: object) -> str:
    """The message of the ConfigurationError register_saga raises for `saga`."""
    app = App("orders")
    with pytest.raises(ConfigurationError) as raised:
        app.register_saga(saga)  # type: ignore[arg-type]
    assert app.sagas == []
    return str(raised.value)


# A valid saga's spec.


def test_a_valid_saga_spec_finds_methods_by_annotation_unions_included() -> None:
    spec = spec_of(OrderFulfilment)

    assert spec.cls is OrderFulfilment
    assert spec.name == "shop.OrderFulfilment"
    assert spec.data_type is Fulfilment
    assert spec.started_by == (OrderPlaced,)
    assert dict(spec.methods) == {
        OrderPlaced: "placed",
        PaymentReceived: "settled",
        OrderCancelled: "settled",
        StockReserved: "reserved",
        PaymentOverdue: "timed_out",
        Reminder: "timed_out",
    }
    assert spec.pessimistic is False
    assert spec_of(OrderFulfilment, pessimistic=True).pessimistic is True


def test_timeouts_are_the_types_with_a_method_but_no_correlation() -> None:
    spec = spec_of(OrderFulfilment)

    assert sorted(t.__name__ for t in spec.timeouts) == ["PaymentOverdue", "Reminder"]
    assert spec.correlate(PaymentOverdue) is None
    assert spec.starts(OrderPlaced) and not spec.starts(PaymentReceived)


def test_correlation_is_an_attribute_or_a_function() -> None:
    spec = spec_of(OrderFulfilment)

    by_attribute, by_function = spec.correlate(OrderPlaced), spec.correlate(StockReserved)
    assert by_attribute is not None and by_function is not None
    assert by_attribute(OrderPlaced("o-1")) == "o-1"
    assert by_function(StockReserved("o-2")) == "o-2"


def test_a_subclass_of_a_message_type_finds_the_base_types_method_and_correlation() -> None:
    @dataclass
    class ExpressOrderPlaced(OrderPlaced):
        pass

    spec = spec_of(OrderFulfilment)

    assert spec.method_for(ExpressOrderPlaced) == "placed"
    assert spec.starts(ExpressOrderPlaced)
    correlate = spec.correlate(ExpressOrderPlaced)
    assert correlate is not None and correlate(ExpressOrderPlaced("o-9")) == "o-9"


def test_the_default_name_is_module_and_qualified_name() -> None:
    assert Unnamed.saga_name == f"{__name__}.Unnamed"
    assert spec_of(Unnamed).name == f"{__name__}.Unnamed"


def test_register_saga_lists_the_saga_and_registers_its_types() -> None:
    app = App("orders")
    app.register_saga(OrderFulfilment)

    assert app.sagas == [OrderFulfilment]
    assert app.saga_spec(OrderFulfilment).name == "shop.OrderFulfilment"
    for message_type in (OrderPlaced, PaymentReceived, StockReserved, PaymentOverdue):
        assert app.handlers.has_handler(message_type)


def test_saga_spec_of_an_unregistered_saga_names_register_saga() -> None:
    app = App("orders")
    with pytest.raises(ConfigurationError, match=r"app\.register_saga\(\.\.\.\) it first"):
        app.saga_spec(OrderFulfilment)


def test_new_data_without_defaults_says_to_give_defaults_or_override_new_data() -> None:
    @dataclass
    class Strict:
        order_id: str

    class NeedsArguments(Saga[Strict]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    with pytest.raises(ConfigurationError) as raised:
        NeedsArguments().new_data(OrderPlaced("o-1"))
    assert "give every field a default" in str(raised.value)
    assert "def new_data(self, message)" in str(raised.value)


async def test_request_timeout_outside_a_handler_says_where_it_works() -> None:
    saga = OrderFulfilment()
    with pytest.raises(MersalError, match="only inside a saga's method"):
        await saga.request_timeout(1, PaymentOverdue("o-1"))


# Every ConfigurationError of register_saga, each naming its fix.


def test_not_a_saga_subclass_is_refused() -> None:
    class Plain:
        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Plain)
    assert "takes a subclass of mersal.sagas.Saga" in message
    assert "takes a subclass of mersal.sagas.Saga" in refusal(OrderFulfilment())


def test_a_saga_without_its_data_type_is_refused() -> None:
    class Bare(Saga):  # type: ignore[type-arg]
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Bare)
    assert "does not say what its data is" in message
    assert "`class Bare(Saga[YourData])`" in message


def test_data_that_cannot_be_stored_is_refused() -> None:
    class Plain(Saga[NotAMessage]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Plain)
    assert "NotAMessage cannot be stored" in message
    assert "make it a dataclass, a pydantic model or a msgspec Struct" in message


def test_a_saga_with_no_handling_method_is_refused() -> None:
    class Idle(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def _private(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Idle)
    assert "handles nothing" in message
    assert "async def placed(self, event: OrderPlaced)" in message


def test_two_methods_for_one_type_are_refused() -> None:
    class Twice(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def first(self, event: OrderPlaced) -> None:
            pass

        async def second(self, event: OrderPlaced | PaymentReceived) -> None:
            pass

    message = refusal(Twice)
    assert "both take OrderPlaced" in message
    assert "one method per message type" in message


@pytest.mark.parametrize("count", [0, 2])
def test_a_method_without_exactly_one_parameter_is_refused(count: int) -> None:
    class Wrong(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    async def none(self: Any) -> None:
        pass

    async def two(self: Any, event: PaymentReceived, other: PaymentReceived) -> None:
        pass

    Wrong.paid = none if count == 0 else two  # type: ignore[attr-defined]
    message = refusal(Wrong)
    assert "Wrong.paid must take exactly one message" in message
    assert "make helpers private (`_name`)" in message


@pytest.mark.parametrize(
    "annotation", [None, "missing", int | str, list[OrderPlaced]], ids=["none", "str", "u", "g"]
)
def test_a_method_without_a_class_annotation_is_refused(annotation: object) -> None:
    class Loose(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    async def paid(self: Any, event: Any) -> None:
        pass

    if annotation is None:
        del paid.__annotations__["event"]
    elif annotation != "missing":
        paid.__annotations__["event"] = annotation
    else:
        paid.__annotations__["event"] = "NoSuchName"
    Loose.paid = paid  # type: ignore[attr-defined]
    message = refusal(Loose)
    if annotation == "missing":
        assert "cannot read the type hints of " in message
        assert "Loose.paid (name 'NoSuchName' is not defined)" in message
        assert "import the annotated types at module level" in message
    elif annotation == int | str:
        # int and str are classes: the annotation is accepted, the codec then refuses int
        assert "int is not a message class" in message
        assert "wrap the value in one" in message
    else:
        assert "needs the message class as its annotation" in message
        assert "`(self, message: SomeMessage)`" in message


def test_correlation_naming_a_type_without_a_method_is_refused() -> None:
    class Extra(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id", PaymentReceived: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Extra)
    assert "Extra.correlation names PaymentReceived, which no method of" in message
    assert "add `async def ...(self, message: PaymentReceived)`" in message


def test_a_saga_with_no_start_message_is_refused() -> None:
    class Endless(Saga[Fulfilment]):
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Endless)
    assert "has no start message" in message
    assert "set `started_by = (SomeMessage,)`" in message


def test_a_start_type_without_correlation_is_refused() -> None:
    class Unfindable(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {PaymentReceived: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

        async def paid(self, event: PaymentReceived) -> None:
            pass

    message = refusal(Unfindable)
    assert "started by OrderPlaced, which needs a correlation" in message
    assert "add `OrderPlaced: 'attribute'` to" in message
    assert message.endswith("Unfindable.correlation")


@pytest.mark.parametrize("how", ["", 42, None])
def test_a_correlation_that_is_neither_attribute_nor_function_is_refused(how: object) -> None:
    class Odd(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: how}  # type: ignore[dict-item]

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Odd)
    assert "must be an attribute name or a function of the message" in message


def test_a_correlation_that_is_not_a_mapping_of_classes_is_refused() -> None:
    class Listed(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = [(OrderPlaced, "order_id")]  # type: ignore[assignment]

        async def placed(self, event: OrderPlaced) -> None:
            pass

    message = refusal(Listed)
    assert "must map message classes to an attribute name or a function" in message


def test_started_by_listing_a_non_class_is_refused() -> None:
    class Started(Saga[Fulfilment]):
        started_by = ("OrderPlaced",)  # type: ignore[assignment]
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    assert "started_by must list message classes" in refusal(Started)


def test_pessimistic_must_be_a_bool() -> None:
    app = App("orders")
    with pytest.raises(ConfigurationError, match="takes True or False"):
        app.register_saga(OrderFulfilment, pessimistic="yes")  # type: ignore[arg-type]


def test_a_message_type_the_codec_cannot_carry_is_refused() -> None:
    class Carries(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

        async def other(self, event: NotAMessage) -> None:
            pass

    message = refusal(Carries)
    assert "NotAMessage is not a message class" in message
    assert "decorate it with @dataclass" in message


def test_two_sagas_with_one_name_are_refused() -> None:
    class Again(Saga[Fulfilment], name="shop.OrderFulfilment"):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    app = App("orders")
    app.register_saga(OrderFulfilment)
    with pytest.raises(ConfigurationError) as raised:
        app.register_saga(Again)
    assert "are both saga 'shop.OrderFulfilment'" in str(raised.value)
    assert "give one another name (`class ...(Saga[D], name='...')`)" in str(raised.value)
    assert app.sagas == [OrderFulfilment]


async def test_register_saga_after_start_is_refused(memory_url: str) -> None:
    app = App("orders", transport=memory_url)
    async with app:
        with pytest.raises(ConfigurationError) as raised:
            app.register_saga(OrderFulfilment)
    assert "register sagas" in str(raised.value)
    assert app.sagas == []


async def test_a_send_only_app_with_a_saga_is_refused_at_start(memory_url: str) -> None:
    app = App("orders", transport=memory_url, consume=False)
    app.register_saga(OrderFulfilment)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert "is send-only (consume=False) and receives nothing" in str(raised.value)
    assert "let it consume (App(consume=True), the default)" in str(raised.value)
    assert not app.running


class NoSagaStorage:
    """A storage (unit of work, inbox, outbox) that keeps no sagas: no `sagas` attribute."""

    parked = 0
    relay = None

    async def unit_of_work(self, context: Any, next: Any) -> None:
        await next(context)

    async def check_inbox(self, context: Any, next: Any) -> None:
        await next(context)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def transaction(self, session: Any) -> Any:
        raise NotImplementedError

    async def pending(self) -> int:
        return 0


async def test_a_storage_without_a_saga_store_is_refused_at_start(memory_url: str) -> None:
    app = App("orders", transport=memory_url)
    app.use_storage(NoSagaStorage())
    app.register_saga(OrderFulfilment)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert "(NoSagaStorage) keeps no sagas" in str(raised.value)
    assert "use mersal_sqlalchemy's, or drop the register_saga calls" in str(raised.value)
    assert not app.running


async def test_a_saga_needing_a_session_without_a_database_is_refused_at_start(
    memory_url: str,
) -> None:
    class Writes(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        def __init__(self, session: AsyncSession) -> None:
            self.session = session

        async def placed(self, event: OrderPlaced) -> None:
            pass

    app = App("orders", transport=memory_url)
    app.register_saga(Writes)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    message = str(raised.value)
    assert "Writes" in message and "AsyncSession" in message
    assert "database" in message.lower()
    assert not app.running


# Correlation values as stored.


def test_none_and_empty_correlation_values_are_invalid_correlations() -> None:
    spec = spec_of(OrderFulfilment)
    for value in (None, ""):
        with pytest.raises(InvalidCorrelation) as raised:
            correlation_key(value, spec, OrderPlaced)
        assert isinstance(raised.value, DecodeError)
        assert "no saga can be found by it" in str(raised.value)
        assert "OrderPlaced" in str(raised.value) and "OrderFulfilment" in str(raised.value)


def test_correlation_values_are_their_text_bytes_their_hex() -> None:
    spec = spec_of(OrderFulfilment)

    assert correlation_key("o-1", spec, OrderPlaced) == "o-1"
    assert correlation_key(42, spec, OrderPlaced) == "42"
    assert correlation_key(0, spec, OrderPlaced) == "0"
    assert correlation_key(b"\x01\xab", spec, OrderPlaced) == "01ab"


def test_long_or_nul_correlation_values_are_hashed() -> None:
    spec = spec_of(OrderFulfilment)
    longest = "x" * CORRELATION_LENGTH
    long = "y" * 300

    assert correlation_key(longest, spec, OrderPlaced) == longest
    digest = "sha256:" + hashlib.sha256(long.encode()).hexdigest()
    assert correlation_key(long, spec, OrderPlaced) == digest
    assert len(digest) <= CORRELATION_LENGTH
    assert correlation_key("a\x00b", spec, OrderPlaced).startswith("sha256:")
    assert correlation_key("z" * 301, spec, OrderPlaced) != digest


def test_the_timeout_headers_are_named_on_the_wire() -> None:
    assert Header.SAGA_ID == "saga-id"
    assert Header.SAGA_TYPE == "saga-type"


def test_an_empty_bytes_correlation_value_is_invalid_too() -> None:
    """b"" is empty as surely as "" is: its stored key would be "", which is refused for str."""
    spec = spec_of(OrderFulfilment)
    with pytest.raises(InvalidCorrelation):
        correlation_key(b"", spec, OrderPlaced)
