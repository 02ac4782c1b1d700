"""Configuration mistakes raise a MersalError subclass whose message says what to change."""

from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session

from mersal import App, ConfigurationError, MersalError, NotRunning, RetryPolicy, message
from mersal.testing import Harness


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class Unrouted:
    n: int


@message("shared.Name.v1")
@dataclass
class First:
    a: int


@message("shared.Name.v1")
@dataclass
class Second:
    b: int


class PaymentGateway:
    """A dependency nobody binds; it needs a URL, which no container can invent."""

    def __init__(self, url: str) -> None:
        self.url = url


class ChargeHandler:
    def __init__(self, gateway: PaymentGateway) -> None:
        self.gateway = gateway

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class NotCallable:
    """A handler class someone forgot to give a `__call__`."""

    def __init__(self) -> None:
        pass


class SyncCall:
    """A handler class whose `__call__` is not async."""

    def __call__(self, message: PlaceOrder) -> None:
        pass


async def noop(message: object) -> None:
    pass


def test_an_unknown_transport_scheme_names_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("a", transport="kafka://x")
    text = str(raised.value)
    assert "kafka://x" in text
    assert "memory://" in text
    assert "amqp://" in text


async def test_sending_an_unrouted_type_says_to_call_app_route() -> None:
    app = App("a")
    async with Harness(app):
        with pytest.raises(ConfigurationError) as raised:
            await app.send(Unrouted(1))
    assert "Unrouted" in str(raised.value)
    assert "app.route(Unrouted" in str(raised.value)


async def test_a_handler_needing_an_unprovided_type_fails_at_start() -> None:
    app = App("billing")
    app.register(PlaceOrder, ChargeHandler)  # registering is fine; start() checks
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler ChargeHandler needs gateway: PaymentGateway -> url: str, and a str cannot be "
        "injected by its type: give `url` a default, or bind PaymentGateway in the lagom "
        "Container passed as App(container=...), e.g. container[PaymentGateway] = "
        "PaymentGateway(...)"
    )
    assert not app.running


class SyncSessionHandler:
    def __init__(self, session: Session) -> None:
        self.session = session

    async def __call__(self, message: PlaceOrder) -> None:
        pass


async def test_a_handler_asking_for_the_sync_session_is_told_to_ask_for_async_session() -> None:
    app = App("a")
    app.register(PlaceOrder, SyncSessionHandler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler SyncSessionHandler needs session: Session, SQLAlchemy's synchronous session, "
        "which Mersal does not provide: ask for the message's "
        "sqlalchemy.ext.asyncio.AsyncSession instead"
    )


class LabelledHandler:
    def __init__(self, label: str) -> None:
        self.label = label

    async def __call__(self, message: PlaceOrder) -> None:
        pass


async def test_a_handler_needing_a_str_itself_is_to_take_a_default_or_be_an_instance() -> None:
    app = App("billing")
    app.register(PlaceOrder, LabelledHandler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler LabelledHandler needs label: str, and a str cannot be injected by its type: "
        "give `label` a default, or register an instance, LabelledHandler(...), in place of "
        "the class"
    )


async def test_a_handler_instance_holding_its_str_runs() -> None:
    got: list[str] = []

    class Labelled:
        def __init__(self, label: str) -> None:
            self.label = label

        async def __call__(self, message: PlaceOrder) -> None:
            got.append(self.label)

    app = App("billing")
    app.register(PlaceOrder, Labelled("eu"))
    app.route(PlaceOrder, "billing")
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1"))
        await bus.idle()
    assert got == ["eu"]


class Unresolvable:
    """A library's class whose constructor's hints name what its module does not import."""

    def __init__(self, mapper: "Mapper") -> None:  # noqa: F821
        self.mapper = mapper


class UnresolvableHandler:
    def __init__(self, thing: Unresolvable) -> None:
        self.thing = thing

    async def __call__(self, message: PlaceOrder) -> None:
        pass


async def test_a_dependency_whose_hints_do_not_resolve_is_to_be_bound() -> None:
    app = App("a")
    app.register(PlaceOrder, UnresolvableHandler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler UnresolvableHandler needs thing: Unresolvable, which nobody provides (nor can "
        "it be built: Unresolvable.__init__'s type hints do not resolve): bind it in the lagom "
        "Container passed as App(container=...), e.g. container[Unresolvable] = ..."
    )


class Unhinted:
    """A library's class whose constructor's parameters carry no type hints."""

    def __init__(self, url, timeout=5.0) -> None:  # type: ignore[no-untyped-def]
        self.url = url


class UnhintedHandler:
    def __init__(self, client: Unhinted) -> None:
        self.client = client

    async def __call__(self, message: PlaceOrder) -> None:
        pass


async def test_a_dependency_without_type_hints_is_to_be_bound() -> None:
    app = App("a")
    app.register(PlaceOrder, UnhintedHandler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        "handler UnhintedHandler needs client: Unhinted, which nobody provides (nor can it be "
        "built: Unhinted.__init__'s parameter 'url' has no type hint): bind it in the lagom "
        "Container passed as App(container=...), e.g. container[Unhinted] = ..."
    )


def test_one_message_name_on_two_classes_is_refused() -> None:
    app = App("a")
    app.register(First, noop)
    with pytest.raises(ConfigurationError) as raised:
        app.register(Second, noop)
    text = str(raised.value)
    assert "shared.Name.v1" in text
    assert "First" in text
    assert "Second" in text
    assert "@message(" in text


async def test_subscribing_without_a_handler_fails_at_start() -> None:
    app = App("billing")
    app.subscribe(PlaceOrder)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    text = str(raised.value)
    assert "PlaceOrder" in text
    assert "app.register(PlaceOrder" in text
    assert not app.running


@pytest.mark.parametrize("name", ["", "has space", "-leading-dash", "x" * 201, "semi;colon"])
def test_invalid_app_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        App(name)
    assert "App(name)" in str(raised.value)
    assert "letters, digits" in str(raised.value)


@pytest.mark.parametrize("queue", ["", "two words", "#hash", "é"])
def test_invalid_route_queue_names_are_refused(queue: str) -> None:
    app = App("a")
    with pytest.raises(ConfigurationError) as raised:
        app.route(PlaceOrder, queue)
    assert "route(PlaceOrder, queue)" in str(raised.value)
    assert "not a usable queue name" in str(raised.value)


def test_an_invalid_error_queue_name_is_refused() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("a", retry=RetryPolicy(error_queue="dead letters"))
    assert "RetryPolicy(error_queue)" in str(raised.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"immediate": -1}, "immediate"),
        ({"delayed": [1.0, -2.0]}, "delayed"),
        ({"fail_fast": ("ValueError",)}, "exception classes"),
    ],
)
def test_an_invalid_retry_policy_is_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_an_invalid_concurrency_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        App("a", concurrency=0)


async def test_send_before_start_raises_not_running() -> None:
    app = App("a")
    app.route(PlaceOrder, "orders")
    for call in (app.send, app.send_local, app.publish):
        with pytest.raises(NotRunning) as raised:
            await call(PlaceOrder("o-1"))
        assert "app.start()" in str(raised.value)
    with pytest.raises(NotRunning):
        await app.defer(1.0, PlaceOrder("o-1"))
    with pytest.raises(NotRunning):
        async with app.transaction():
            pass
    assert issubclass(NotRunning, MersalError)


async def test_registering_after_start_is_refused() -> None:
    app = App("a")
    async with Harness(app):
        with pytest.raises(ConfigurationError) as raised:
            app.register(PlaceOrder, noop)
        assert "before app 'a' starts" in str(raised.value)
        with pytest.raises(ConfigurationError, match="before app 'a' starts"):
            app.route(PlaceOrder, "orders")
        with pytest.raises(ConfigurationError, match="before app 'a' starts"):
            app.subscribe(PlaceOrder)


def test_a_handler_class_without_call_is_refused() -> None:
    app = App("a")
    with pytest.raises(ConfigurationError, match="__call__"):
        app.register(PlaceOrder, NotCallable)


def test_a_handler_class_with_a_sync_call_is_refused() -> None:
    app = App("a")
    with pytest.raises(ConfigurationError, match="async def __call__"):
        app.register(PlaceOrder, SyncCall)


def test_a_non_async_function_handler_is_refused() -> None:
    def handle(message: PlaceOrder) -> None:
        pass

    app = App("a")
    with pytest.raises(ConfigurationError) as raised:
        app.register(PlaceOrder, handle)
    assert "async def" in str(raised.value)


def test_the_same_handler_twice_for_one_type_is_refused() -> None:
    app = App("a")
    app.register(PlaceOrder, noop)
    with pytest.raises(ConfigurationError, match="already registered"):
        app.register(PlaceOrder, noop)


def test_registering_something_that_is_not_a_class_is_refused() -> None:
    app = App("a")
    with pytest.raises(ConfigurationError, match="message class"):
        app.register("PlaceOrder", noop)  # type: ignore[arg-type]


def test_every_configuration_error_is_a_mersal_error() -> None:
    assert issubclass(ConfigurationError, MersalError)
