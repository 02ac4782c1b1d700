"""Saga classes read and checked at register_saga (no servers): the spec, and every refusal.

Every ConfigurationError must say what to change, so each test checks the fix is named.
"""

import hashlib
import re
from dataclasses import InitVar, dataclass, field
from typing import Any, Union

import attrs
import msgspec
import pydantic
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
from mersal.testing import Harness


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
    assert app.sagas.classes == []
    return str(raised.value)


def plain(message: str) -> str:
    """`message` with the classes defined in a test named as in a module (no `<locals>`)."""
    return re.sub(r"\w+\.<locals>\.", "", message)


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

    assert app.sagas.classes == [OrderFulfilment]
    assert app.sagas.spec(OrderFulfilment).name == "shop.OrderFulfilment"
    for message_type in (OrderPlaced, PaymentReceived, StockReserved, PaymentOverdue):
        assert app.handlers.has_handler(message_type)


def test_saga_spec_of_an_unregistered_saga_names_register_saga() -> None:
    app = App("orders")
    with pytest.raises(ConfigurationError, match=r"app\.register_saga\(\.\.\.\) it first"):
        app.sagas.spec(OrderFulfilment)


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


def test_a_plain_def_method_taking_a_correlated_message_is_refused() -> None:
    class Sync(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        def placed(self, event: OrderPlaced) -> None:
            pass

        def total(self, amount: int) -> int:  # a helper: no message of the saga's
            return amount

    assert plain(refusal(Sync)) == (
        "Sync.placed takes OrderPlaced but is not async, so it would never run: write "
        "`async def placed(self, message: OrderPlaced)`"
    )


def test_a_plain_def_helper_beside_the_async_method_of_its_message_is_accepted() -> None:
    class Helped(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            self.data.order_id = self.key(event)

        def key(self, event: OrderPlaced) -> str:
            return event.order_id.upper()

    assert saga_spec(Helped, JsonCodec()).methods == {OrderPlaced: "placed"}


class Regional(Saga[Fulfilment]):
    started_by = (OrderPlaced,)
    correlation = {OrderPlaced: "order_id"}

    def __init__(self, region: str) -> None:
        self.region = region

    async def placed(self, event: OrderPlaced) -> None:
        pass


async def test_a_saga_needing_a_str_is_to_take_a_default_or_a_class_holding_it() -> None:
    app = App("orders")
    app.register_saga(Regional)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler Regional needs region: str, and a str cannot be injected by its type: give "
        "`region` a default, or ask for a class of yours that holds it, which the container "
        "builds or is given"
    )


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
    assert app.sagas.classes == [OrderFulfilment]


async def test_register_saga_after_start_is_refused(memory_url: str) -> None:
    app = App("orders", transport=memory_url)
    async with app:
        with pytest.raises(ConfigurationError) as raised:
            app.register_saga(OrderFulfilment)
    assert "register sagas" in str(raised.value)
    assert app.sagas.classes == []


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


# A type the saga takes without a correlation reaches it only as a timeout.


@dataclass
class OrderShipped:
    order_id: str


class Shipping(Saga[Fulfilment]):
    started_by = (OrderPlaced,)
    correlation = {OrderPlaced: "order_id"}

    async def placed(self, event: OrderPlaced) -> None:
        pass

    async def shipped(self, event: OrderShipped) -> None:
        pass


SUBSCRIBED_TIMEOUT = (
    "Shipping takes OrderShipped (method shipped) but has no correlation for it, and the app "
    "subscribes to OrderShipped: a published OrderShipped would never find its saga. Add "
    "`OrderShipped: 'order_id'` to Shipping.correlation (or, if OrderShipped is only this "
    "saga's timeout, do not subscribe to it; if the app subscribes to it for another handler, "
    "give the timeout a type of its own)"
)


def test_subscribing_to_a_type_the_saga_takes_without_correlation_is_refused() -> None:
    app = App("orders")
    app.register_saga(Shipping)
    with pytest.raises(ConfigurationError) as raised:
        app.subscribe(OrderShipped)

    assert str(raised.value) == SUBSCRIBED_TIMEOUT
    assert app.subscriptions == []


def test_a_saga_taking_a_subscribed_type_without_correlation_is_refused() -> None:
    app = App("orders")
    app.subscribe(OrderShipped)
    with pytest.raises(ConfigurationError) as raised:
        app.register_saga(Shipping)

    assert str(raised.value) == SUBSCRIBED_TIMEOUT
    assert app.sagas.classes == []
    assert not app.handlers.has_handler(OrderShipped)


def test_a_subscribed_subclass_of_a_timeout_type_is_refused_by_its_own_name() -> None:
    @dataclass
    class ExpressShipped(OrderShipped):
        pass

    app = App("orders")
    app.register_saga(Shipping)
    with pytest.raises(ConfigurationError) as raised:
        app.subscribe(ExpressShipped)

    message = plain(str(raised.value))
    assert message.startswith("Shipping takes ExpressShipped (method shipped) but has no ")
    assert "Add `ExpressShipped: 'order_id'` to Shipping.correlation" in message


def test_the_suggested_correlation_is_an_attribute_the_subscribed_type_has() -> None:
    @dataclass
    class Cancelled:
        reason: str

    class Cancelling(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

        async def cancelled(self, event: Cancelled) -> None:
            pass

    app = App("orders")
    app.register_saga(Cancelling)
    with pytest.raises(ConfigurationError) as raised:
        app.subscribe(Cancelled)
    assert "Add `Cancelled: 'attribute'` to Cancelling.correlation" in plain(str(raised.value))


def test_subscribing_to_a_type_the_saga_correlates_is_accepted() -> None:
    app = App("orders")
    app.register_saga(OrderFulfilment)
    app.subscribe(PaymentReceived)
    app.subscribe(OrderPlaced)

    assert app.subscriptions == [PaymentReceived, OrderPlaced]


class Chasing(Saga[Fulfilment]):
    """A saga with a timeout: PaymentOverdue has no correlation, it comes back by saga id."""

    started_by = (OrderPlaced,)
    correlation = {OrderPlaced: "order_id", PaymentReceived: "order_id"}

    async def placed(self, event: OrderPlaced) -> None:
        self.data.order_id = event.order_id
        await self.request_timeout(3600, PaymentOverdue(event.order_id))

    async def paid(self, event: PaymentReceived) -> None:
        self.data.paid = True

    async def overdue(self, timeout: PaymentOverdue) -> None:
        self.data.notes.append(f"overdue, paid={self.data.paid}")


@pytest.mark.parametrize("routed_home", [False, True], ids=["not-routed", "routed-home"])
async def test_a_saga_with_a_timeout_registers_and_runs_whether_or_not_it_is_routed_home(
    routed_home: bool,
) -> None:
    """A route to the app's own queue is no subscription: the app sends what it routes there
    itself, and may send a timeout type with a saga's headers; request_timeout ignores it."""
    app = App("orders")
    app.register_saga(Chasing)
    app.subscribe(OrderPlaced)
    app.subscribe(PaymentReceived)
    if routed_home:
        app.route(PaymentOverdue, "orders")
    async with Harness(app) as bus:
        await app.publish(OrderPlaced("o-1"))
        await app.publish(PaymentReceived("o-1"))
        await bus.idle(include_delayed=False)
        assert bus.deliver_delayed() == 1
        await bus.idle()

        data = await bus.saga_data(Chasing, "o-1")
        assert data == Fulfilment("o-1", paid=True, notes=["overdue, paid=True"])
    assert bus.dead_lettered == []


# A correlation attribute the message class does not have.


def test_a_correlation_attribute_missing_from_a_dataclass_is_refused_with_the_closest_field() -> (
    None
):
    class Typo(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "orderid"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    assert plain(refusal(Typo)) == (
        "Typo.correlation[OrderPlaced] is 'orderid', but OrderPlaced has no attribute "
        "'orderid': did you mean 'order_id'? Name one of its fields (order_id), or give a "
        "function of the message"
    )


@attrs.define
class AttrsPlaced:
    order_id: str
    total: int = 0


class StructPlaced(msgspec.Struct):
    order_id: str
    total: int = 0


class ModelPlaced(pydantic.BaseModel):
    order_id: str
    total: int = 0


@pytest.mark.parametrize("placed", [AttrsPlaced, StructPlaced, ModelPlaced])
def test_a_correlation_attribute_is_checked_for_every_kind_of_message_class(
    placed: type,
) -> None:
    class Far(Saga[Fulfilment]):
        started_by = (placed,)
        correlation = {placed: "reference"}

        async def start(self, event: placed) -> None:  # type: ignore[valid-type]
            pass

    assert plain(refusal(Far)) == (
        f"Far.correlation[{placed.__qualname__}] is 'reference', but {placed.__qualname__} has "
        "no attribute 'reference': name one of its fields (order_id, total), or give a "
        "function of the message"
    )


class AliasedPlaced(pydantic.BaseModel):
    order_id: str = pydantic.Field(alias="orderId")


class RenamedPlaced(msgspec.Struct, rename="camel"):
    order_id: str


@pytest.mark.parametrize("placed", [AliasedPlaced, RenamedPlaced])
def test_a_correlation_naming_a_stored_name_says_to_name_the_attribute(placed: type) -> None:
    class Aliased(Saga[Fulfilment]):
        started_by = (placed,)
        correlation = {placed: "orderId"}

        async def start(self, event: placed) -> None:  # type: ignore[valid-type]
            pass

    assert plain(refusal(Aliased)) == (
        f"Aliased.correlation[{placed.__qualname__}] is 'orderId', but {placed.__qualname__} "
        "has no attribute 'orderId' ('orderId' is how its field 'order_id' is stored; the "
        "correlation reads the attribute): name 'order_id', or give a function of the message"
    )


def test_a_correlation_attribute_of_a_class_without_fields_is_refused() -> None:
    @dataclass
    class Ping:
        pass

    class Pinged(Saga[Fulfilment]):
        started_by = (Ping,)
        correlation = {Ping: "id"}

        async def ping(self, event: Ping) -> None:
            pass

    assert plain(refusal(Pinged)) == (
        "Pinged.correlation[Ping] is 'id', but Ping has no attribute 'id', nor any field: "
        "give a function of the message"
    )


def test_correlation_attributes_that_messages_have_without_a_field_are_accepted() -> None:
    """A property, a field of every subclass of a base type, an extra field that pydantic keeps,
    and any attribute of a class whose fields are not known (a __getattr__, a __post_init__)."""

    @dataclass
    class Keyed:
        region: str
        number: int

        @property
        def key(self) -> str:
            return f"{self.region}-{self.number}"

    @dataclass
    class Event:
        pass

    @dataclass
    class Paid(Event):
        order_id: str

    class Loose(pydantic.BaseModel, extra="allow"):
        pass

    @dataclass
    class Dynamic:
        def __getattr__(self, name: str) -> str:
            return name

    @dataclass
    class Derived:
        region: str

        def __post_init__(self) -> None:
            self.key = f"{self.region}-1"

    class Accepting(Saga[Fulfilment]):
        started_by = (Keyed,)
        correlation = {
            Keyed: "key",
            Event: "order_id",
            Loose: "order_id",
            Dynamic: "anything",
            Derived: "key",
        }

        async def keyed(self, event: Keyed) -> None:
            pass

        async def event(self, event: Event) -> None:
            pass

        async def loose(self, event: Loose) -> None:
            pass

        async def dynamic(self, event: Dynamic) -> None:
            pass

        async def derived(self, event: Derived) -> None:
            pass

    app = App("orders")
    app.register_saga(Accepting)
    assert app.sagas.classes == [Accepting]


def test_a_correlation_naming_a_method_of_the_message_is_refused() -> None:
    @dataclass
    class Keyed:
        region: str

        def key(self) -> str:
            return self.region

    class ByMethod(Saga[Fulfilment]):
        started_by = (Keyed,)
        correlation = {Keyed: "key"}

        async def keyed(self, event: Keyed) -> None:
            pass

    assert plain(refusal(ByMethod)) == (
        "ByMethod.correlation[Keyed] is 'key', a method of Keyed: the correlation would be the "
        "method itself, not what it returns, and would find no saga. Make it a @property, or "
        "give a function of the message, `lambda message: message.key()`"
    )


def test_a_correlation_function_that_cannot_take_the_message_alone_is_refused() -> None:
    def both(message: OrderPlaced, other: str) -> str:
        return message.order_id + other

    class TwoArguments(Saga[Fulfilment]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: both}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    assert plain(refusal(TwoArguments)) == (
        "TwoArguments.correlation[OrderPlaced] is correlation function 'both', which cannot "
        "be called with the message alone (missing a required argument: "
        "'other'): give a function of one argument, e.g. `lambda message: message.order_id`"
    )


# A new saga's data: made without arguments unless new_data is overridden.


@dataclass
class OrderData:
    order_id: str
    total: int
    shipped: bool = False
    notes: list[str] = field(default_factory=list)


class Placed(msgspec.Struct):
    order_id: str
    total: int


def test_data_with_required_fields_and_no_new_data_is_refused_with_a_new_data_to_write() -> None:
    class Needy(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        async def placed(self, event: Placed) -> None:
            pass

    assert plain(refusal(Needy)) == (
        "Needy does not override new_data, and its data OrderData cannot be made without "
        "arguments: order_id, total have no default, so every start message would be "
        "dead-lettered. Give them defaults, or make the data from the start message: "
        "`def new_data(self, message: Placed) -> OrderData: return OrderData("
        "order_id=message.order_id, total=message.total)`"
    )


@attrs.define
class AttrsData:
    order_id: str
    n: int = 0


class StructData(msgspec.Struct):
    order_id: str
    n: int = 0


class ModelData(pydantic.BaseModel):
    order_id: str
    n: int = 0


@pytest.mark.parametrize("data", [AttrsData, StructData, ModelData])
def test_required_fields_are_found_in_every_kind_of_data_class(data: type) -> None:
    class Needy(Saga[data]):  # type: ignore[valid-type]
        started_by = (OrderPlaced, OrderCancelled)
        correlation = {OrderPlaced: "order_id", OrderCancelled: "order_id"}

        async def placed(self, event: OrderPlaced | OrderCancelled) -> None:
            pass

    assert plain(refusal(Needy)) == (
        f"Needy does not override new_data, and its data {data.__qualname__} cannot be made "
        "without arguments: order_id has no default, so every start message would be "
        "dead-lettered. Give it a default, or make the data from the start message: "
        f"`def new_data(self, message: OrderPlaced | OrderCancelled) -> {data.__qualname__}: "
        f"return {data.__qualname__}(order_id=message.order_id)`"
    )


@dataclass
class Seeded:
    seed: InitVar[int]
    n: int = 0


@dataclass(init=False)
class SelfMade:
    n: int

    def __init__(self) -> None:
        self.n = 0


def test_required_dataclass_arguments_are_read_from_its_init() -> None:
    class NeedsSeed(Saga[Seeded]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    class MakesItself(Saga[SelfMade]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    assert plain(refusal(NeedsSeed)) == (
        "NeedsSeed does not override new_data, and its data Seeded cannot be made without "
        "arguments: seed has no default, so every start message would be dead-lettered. Give "
        "it a default, or make the data from the start message: `def new_data(self, message: "
        "OrderPlaced) -> Seeded: return Seeded(seed=...)`"
    )
    app = App("orders")
    app.register_saga(MakesItself)
    assert app.sagas.classes == [MakesItself]


def test_a_required_field_the_start_message_lacks_is_left_to_fill_in() -> None:
    @dataclass
    class Counted:
        count: int

    class Counting(Saga[Counted]):
        started_by = (OrderPlaced,)
        correlation = {OrderPlaced: "order_id"}

        async def placed(self, event: OrderPlaced) -> None:
            pass

    assert plain(refusal(Counting)).endswith(
        "`def new_data(self, message: OrderPlaced) -> Counted: return Counted(count=...)`"
    )


def test_data_with_required_fields_and_new_data_overridden_is_accepted() -> None:
    class Made(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        def new_data(self, message: Placed) -> OrderData:
            return OrderData(message.order_id, message.total)

        async def placed(self, event: Placed) -> None:
            pass

    class Inherits(Made):
        pass

    app = App("orders")
    app.register_saga(Made)
    app.register_saga(Inherits)
    assert app.sagas.classes == [Made, Inherits]


def test_an_async_new_data_is_refused() -> None:
    class Awaited(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        async def new_data(self, message: Placed) -> OrderData:  # type: ignore[override]
            return OrderData(message.order_id, message.total)

        async def placed(self, event: Placed) -> None:
            pass

    assert plain(refusal(Awaited)) == (
        "Awaited.new_data is `async def`, but it is called without await: make it a plain "
        "`def new_data(self, message)` that returns the OrderData"
    )


def test_an_async_static_or_class_method_new_data_is_refused() -> None:
    class Static(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        @staticmethod
        async def new_data(message: Placed) -> OrderData:  # type: ignore[override]
            return OrderData(message.order_id, message.total)

        async def placed(self, event: Placed) -> None:
            pass

    class Class(Static):
        @classmethod
        async def new_data(cls, message: Placed) -> OrderData:  # type: ignore[override]
            return OrderData(message.order_id, message.total)

    for saga in (Static, Class):
        assert plain(refusal(saga)) == (
            f"{saga.__name__}.new_data is `async def`, but it is called without await: "
            "make it a plain `def new_data(self, message)` that returns the OrderData"
        )


async def test_a_static_or_class_method_new_data_makes_the_data() -> None:
    class Static(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        @staticmethod
        def new_data(message: Placed) -> OrderData:  # type: ignore[override]
            return OrderData(message.order_id, message.total)

        async def placed(self, event: Placed) -> None:
            pass

    class Class(Static, name="class-made"):
        @classmethod
        def new_data(cls, message: Placed) -> OrderData:  # type: ignore[override]
            return OrderData(message.order_id, message.total + 1)

    app = App("orders")
    app.route(Placed, "orders")
    app.register_saga(Static)
    app.register_saga(Class)
    async with Harness(app) as bus:
        await app.send(Placed("o-1", 5))
        await bus.idle()

        assert await bus.saga_data(Static, "o-1") == OrderData("o-1", 5)
        assert await bus.saga_data(Class, "o-1") == OrderData("o-1", 6)


def test_a_new_data_that_does_not_take_the_message_is_refused() -> None:
    class Blind(Saga[OrderData]):
        started_by = (Placed,)
        correlation = {Placed: "order_id"}

        def new_data(self) -> OrderData:  # type: ignore[override]
            return OrderData("", 0)

        async def placed(self, event: Placed) -> None:
            pass

    assert plain(refusal(Blind)) == (
        "Blind.new_data cannot take the start message (too many positional arguments): "
        "declare it `def new_data(self, message)`"
    )


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
