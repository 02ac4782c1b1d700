"""Handlers: class handlers with injected dependencies, function handlers, order, failures."""

import functools
import logging
from dataclasses import dataclass
from typing import Any, NewType
from unittest.mock import AsyncMock

import pytest
from lagom import Container, Singleton
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from typing_extensions import TypeAliasType

import mersal
from mersal import (
    App,
    ConfigurationError,
    MessageContext,
    RetryPolicy,
)
from mersal.testing import Harness


@dataclass
class PlaceOrder:
    order_id: str
    amount: float


@dataclass
class Notify:
    text: str


@dataclass
class OrderAccepted:
    order_id: str


@dataclass
class Animal:
    name: str


@dataclass
class Dog(Animal):
    breed: str


class Clock:
    """A user dependency bound in the container."""

    def __init__(self, now: float) -> None:
        self.now = now


class Audit:
    """A dependency that wants the message being handled."""

    def __init__(self, context: MessageContext) -> None:
        self.context = context


class Counter:
    """A dependency bound as a singleton: one instance for the whole app."""

    def __init__(self) -> None:
        self.value = 0


async def for_place_order(message: PlaceOrder) -> None:
    pass


def orders_app(**kwargs: Any) -> App:
    app = App("orders", retry=RetryPolicy(immediate=1, delayed=[0.05]), **kwargs)
    app.route(PlaceOrder, "orders")
    return app


async def test_class_handler_gets_app_and_message_context() -> None:
    seen: list[tuple[App, MessageContext, PlaceOrder]] = []

    class Handler:
        def __init__(self, app: App, context: MessageContext) -> None:
            self.app, self.context = app, context

        async def __call__(self, message: PlaceOrder) -> None:
            seen.append((self.app, self.context, message))

    app = orders_app()
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        message_id = await app.send(PlaceOrder("o-1", 9.5), headers={"tenant": "acme"})
        await bus.idle()

    [(injected_app, context, message)] = seen
    assert injected_app is app
    assert message == PlaceOrder("o-1", 9.5)
    assert context.message == message
    assert context.message_id == message_id
    # The first message of a conversation is its own correlation id.
    assert context.correlation_id == message_id
    assert context.headers["tenant"] == "acme"
    assert context.headers == bus.sent[0].headers
    assert context.queue == "orders"
    assert context.attempt == 1


async def test_a_dependency_bound_in_the_user_container_is_injected() -> None:
    clock = Clock(now=1234.5)
    container = Container()
    container[Clock] = clock
    got: list[float] = []

    class Handler:
        def __init__(self, clock: Clock) -> None:
            self.clock = clock

        async def __call__(self, message: PlaceOrder) -> None:
            assert self.clock is clock
            got.append(self.clock.now)

    app = orders_app(container=container)
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert got == [1234.5, 1234.5]


async def test_a_dependency_taking_message_context_gets_the_message_being_handled() -> None:
    seen: list[tuple[Audit, str]] = []

    class Handler:
        def __init__(self, audit: Audit) -> None:
            self.audit = audit

        async def __call__(self, message: PlaceOrder) -> None:
            seen.append((self.audit, self.audit.context.message.order_id))

    app = orders_app()
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        first = await app.send(PlaceOrder("o-1", 1.0))
        second = await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert [order_id for _, order_id in seen] == ["o-1", "o-2"]
    (audit_1, _), (audit_2, _) = seen
    # One scope per message: a new (non-singleton) dependency for each message.
    assert audit_1 is not audit_2
    assert audit_1.context.message_id == first
    assert audit_2.context.message_id == second


async def test_a_container_factory_can_ask_for_the_message_context() -> None:
    container = Container()
    container[Audit] = lambda c: Audit(c[MessageContext])
    seen: list[str] = []

    class Handler:
        def __init__(self, audit: Audit) -> None:
            self.audit = audit

        async def __call__(self, message: PlaceOrder) -> None:
            seen.append(self.audit.context.message_id)

    app = orders_app(container=container)
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        ids = [await app.send(PlaceOrder(f"o-{n}", n)) for n in range(2)]
        await bus.idle()

    assert seen == ids


async def test_two_handlers_of_one_message_share_one_instance_of_a_dependency() -> None:
    """One scope per message: a dependency is built once per message, for all its handlers."""
    seen: list[tuple[str, Audit]] = []

    class First:
        def __init__(self, audit: Audit) -> None:
            self.audit = audit

        async def __call__(self, message: PlaceOrder) -> None:
            seen.append(("first", self.audit))

    class Second:
        def __init__(self, audit: Audit, context: MessageContext) -> None:
            self.audit, self.context = audit, context

        async def __call__(self, message: PlaceOrder) -> None:
            assert self.audit.context is self.context
            seen.append(("second", self.audit))

    app = orders_app()
    app.register(PlaceOrder, First)
    app.register(PlaceOrder, Second)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert [name for name, _ in seen] == ["first", "second"]
    audit_1, audit_2 = (audit for _, audit in seen)
    assert audit_1 is audit_2


async def test_a_singleton_from_the_container_is_shared_across_messages() -> None:
    container = Container()
    container[Counter] = Singleton(Counter)

    class Handler:
        def __init__(self, counter: Counter) -> None:
            self.counter = counter

        async def __call__(self, message: PlaceOrder) -> None:
            self.counter.value += 1

    app = orders_app(container=container)
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        for n in range(3):
            await app.send(PlaceOrder(f"o-{n}", n))
        await bus.idle()

    assert container[Counter].value == 3


async def test_a_handler_class_is_built_anew_for_every_message() -> None:
    instances: list[object] = []

    class Handler:
        async def __call__(self, message: PlaceOrder) -> None:
            instances.append(self)

    app = orders_app()
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert len(instances) == 2
    assert instances[0] is not instances[1]


async def test_a_plain_async_function_handles_messages() -> None:
    got: list[PlaceOrder] = []

    async def handle(message: PlaceOrder) -> None:
        got.append(message)

    app = orders_app()
    app.register(PlaceOrder, handle)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert got == [PlaceOrder("o-1", 1.0), PlaceOrder("o-2", 2.0)]


async def test_a_function_taking_message_and_context_gets_the_context() -> None:
    got: list[tuple[PlaceOrder, str, str]] = []

    async def handle(message: PlaceOrder, context: MessageContext) -> None:
        got.append((message, context.message_id, context.headers["type"]))

    app = orders_app()
    app.register(PlaceOrder, handle)
    async with Harness(app) as bus:
        message_id = await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert got == [(PlaceOrder("o-1", 1.0), message_id, bus.sent[0].headers["type"])]


async def test_every_handler_of_a_type_runs_in_registration_order() -> None:
    calls: list[tuple[str, str]] = []

    async def first(message: PlaceOrder) -> None:
        calls.append(("first", message.order_id))

    class Second:
        async def __call__(self, message: PlaceOrder) -> None:
            calls.append(("second", message.order_id))

    async def third(message: PlaceOrder, context: MessageContext) -> None:
        calls.append(("third", message.order_id))

    app = orders_app(concurrency=1)
    app.register(PlaceOrder, first)
    app.register(PlaceOrder, Second)
    app.register(PlaceOrder, third)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert calls == [
        ("first", "o-1"),
        ("second", "o-1"),
        ("third", "o-1"),
        ("first", "o-2"),
        ("second", "o-2"),
        ("third", "o-2"),
    ]


async def test_a_handler_for_a_base_class_runs_for_a_subclass_message() -> None:
    got: list[tuple[str, Animal]] = []

    async def any_animal(message: Animal) -> None:
        got.append(("animal", message))

    async def dogs_only(message: Dog) -> None:
        got.append(("dog", message))

    sender = App("kennel")
    sender.route(Dog, "vet")
    sender.route(Animal, "vet")
    vet = App("vet")
    vet.register(Animal, any_animal)
    vet.register(Dog, dogs_only)
    async with Harness(sender, vet) as bus:
        await sender.send(Dog("rex", "collie"))
        await bus.idle()
        await sender.send(Animal("tom"))
        await bus.idle()

    assert got == [
        ("animal", Dog("rex", "collie")),
        ("dog", Dog("rex", "collie")),
        ("animal", Animal("tom")),
    ]
    assert type(got[0][1]) is Dog
    assert bus.dead_lettered == []


async def test_a_failing_handler_sends_nothing_and_its_message_is_retried() -> None:
    calls: list[int] = []

    async def handle(message: PlaceOrder, context: MessageContext) -> None:
        calls.append(context.attempt)
        await context.app.send(Notify(f"about {message.order_id}"))
        await context.app.publish(OrderAccepted(message.order_id))
        raise RuntimeError("database is down")

    app = App("orders", retry=RetryPolicy(immediate=1, delayed=[], error_queue="errors"))
    app.route(PlaceOrder, "orders")
    app.route(Notify, "notifications")
    app.register(PlaceOrder, handle)
    async with Harness(app) as bus:
        bus.broker.declare("notifications")
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert calls == [1, 2]
    assert bus.sent_of(Notify) == []
    assert bus.published_of(OrderAccepted) == []
    assert bus.dead_lettered_of(PlaceOrder) == [PlaceOrder("o-1", 1.0)]
    assert len(bus.broker.queues["notifications"]) == 0


async def test_a_handler_that_fails_once_sends_only_what_its_successful_attempt_sent() -> None:
    calls: list[int] = []

    async def handle(message: PlaceOrder, context: MessageContext) -> None:
        calls.append(context.attempt)
        await context.app.send(Notify(f"attempt {context.attempt}"))
        await context.app.publish(OrderAccepted(message.order_id))
        if context.attempt == 1:
            raise RuntimeError("transient")

    app = orders_app()
    app.route(Notify, "notifications")
    app.register(PlaceOrder, handle)
    async with Harness(app) as bus:
        bus.broker.declare("notifications")
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert calls == [1, 2]
    assert bus.sent_of(Notify) == [Notify("attempt 2")]
    assert bus.published_of(OrderAccepted) == [OrderAccepted("o-1")]
    assert bus.dead_lettered == []


async def test_a_receiver_with_only_a_base_class_handler_decodes_the_subclass() -> None:
    got: list[Animal] = []

    async def any_animal(message: Animal) -> None:
        got.append(message)

    sender = App("kennel")
    sender.route(Dog, "vet")
    vet = App("vet")
    vet.register(Animal, any_animal)
    async with Harness(sender, vet) as bus:
        await sender.send(Dog("rex", "collie"))
        await bus.idle()

    assert got == [Dog("rex", "collie")]
    assert type(got[0]) is Dog
    assert bus.dead_lettered == []


class CallableHandler:
    """An object with an async __call__, registered as an instance."""

    def __init__(self) -> None:
        self.got: list[PlaceOrder] = []

    async def __call__(self, message: PlaceOrder) -> None:
        self.got.append(message)


async def test_an_object_with_an_async_call_is_a_handler_and_is_reused() -> None:
    handler = CallableHandler()
    app = orders_app()
    app.register(PlaceOrder, handler)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await app.send(PlaceOrder("o-2", 2.0))
        await bus.idle()

    assert sorted(m.order_id for m in handler.got) == ["o-1", "o-2"]


# Signatures: which parameter receives the message and which the context, checked at register.


@dataclass
class Ping:
    n: int


@dataclass
class Pong:
    n: int


Seen = list[tuple[object, object]]
seen_by_form: Seen = []


async def context_first(context: MessageContext, message: PlaceOrder) -> None:
    seen_by_form.append((message, context))


async def context_by_keyword(message: PlaceOrder, *, context: MessageContext) -> None:
    seen_by_form.append((message, context))


async def both_by_keyword(*, context: MessageContext, message: PlaceOrder) -> None:
    seen_by_form.append((message, context))


async def context_after_a_default(
    message: PlaceOrder, note: str = "kept", context: MessageContext | None = None
) -> None:
    assert note == "kept"
    seen_by_form.append((message, context))


async def unannotated(message, context):
    seen_by_form.append((message, context))


async def unannotated_context(message: PlaceOrder, context) -> None:
    seen_by_form.append((message, context))


async def unannotated_context_first(context, message: PlaceOrder) -> None:
    seen_by_form.append((message, context))


async def unannotated_context_defaulting_to_none(message, context=None):
    seen_by_form.append((message, context))


async def string_annotations(message: "PlaceOrder", context: "MessageContext") -> None:
    seen_by_form.append((message, context))


async def names_imported_for_type_checking_only(
    context: "mersal.MessageContext",
    message: "OnlyForTypeCheckers",  # noqa: F821
) -> None:
    seen_by_form.append((message, context))


class ContextFirstObject:
    async def __call__(self, context: MessageContext, message: PlaceOrder) -> None:
        seen_by_form.append((message, context))


class OrderDesk:
    async def place(self, context: MessageContext, message: PlaceOrder) -> None:
        seen_by_form.append((message, context))


async def with_prefix(prefix: str, message: PlaceOrder, context: MessageContext) -> None:
    assert prefix == "bound"
    seen_by_form.append((message, context))


@pytest.mark.parametrize(
    "handler",
    [
        context_first,
        context_by_keyword,
        both_by_keyword,
        context_after_a_default,
        unannotated,
        unannotated_context,
        unannotated_context_first,
        unannotated_context_defaulting_to_none,
        string_annotations,
        names_imported_for_type_checking_only,
        ContextFirstObject(),
        OrderDesk().place,
        functools.partial(with_prefix, "bound"),
    ],
    ids=lambda handler: getattr(handler, "__name__", type(handler).__name__),
)
async def test_each_accepted_signature_gets_the_message_and_the_context_in_their_places(
    handler: Any,
) -> None:
    seen_by_form.clear()
    app = orders_app()
    app.register(PlaceOrder, handler)
    async with Harness(app) as bus:
        message_id = await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    [(message, context)] = seen_by_form
    assert message == PlaceOrder("o-1", 1.0)
    assert isinstance(context, MessageContext)
    assert context.message_id == message_id
    assert bus.dead_lettered == []


async def test_a_handler_class_call_with_a_defaulted_parameter_keeps_its_default() -> None:
    notes: list[str] = []

    class Handler:
        async def __call__(self, message: PlaceOrder, note: str = "kept") -> None:
            notes.append(f"{message.order_id} {note}")

    app = orders_app()
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert notes == ["o-1 kept"]


def without_wraps(function: Any) -> Any:
    """A decorator that hides the signature of what it decorates."""

    async def wrapper(*args: Any, **kwargs: Any) -> object:
        return await function(*args, **kwargs)

    return wrapper


async def test_a_handler_class_call_decorated_without_wraps_gets_the_message() -> None:
    got: list[PlaceOrder] = []

    class Handler:
        @without_wraps
        async def __call__(self, message: PlaceOrder) -> None:
            got.append(message)

    app = orders_app()
    app.register(PlaceOrder, Handler)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert got == [PlaceOrder("o-1", 1.0)]


@pytest.mark.parametrize(
    "mock", [AsyncMock(), AsyncMock(spec=for_place_order)], ids=["plain", "with-spec"]
)
async def test_an_async_mock_is_called_with_the_message_alone(mock: AsyncMock) -> None:
    app = orders_app()
    app.register(PlaceOrder, mock)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    mock.assert_awaited_once_with(PlaceOrder("o-1", 1.0))


class Repository:
    """A dependency a decorator passes to the function it decorates."""


async def test_a_decorated_function_may_leave_parameters_for_its_decorator_to_fill() -> None:
    got: list[tuple[PlaceOrder, object]] = []

    async def place(message: PlaceOrder, repository: Repository) -> None:
        got.append((message, repository))

    container = Container()
    container[Repository] = Repository()
    app = orders_app()
    app.register(PlaceOrder, container.magic_partial(place))
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))
        await bus.idle()

    assert got == [(PlaceOrder("o-1", 1.0), container[Repository])]


async def for_animals(message: Animal) -> None:
    pass


async def for_dogs_or_nothing(message: Dog | None) -> None:
    pass


async def for_animals_or_notes(message: Notify | Animal) -> None:
    pass


async def for_anything(message: Any) -> None:
    pass


async def for_objects(message: object) -> None:
    pass


AnimalOrNote = TypeAliasType("AnimalOrNote", Animal | Notify)


async def for_an_alias_of_animals_or_notes(message: AnimalOrNote) -> None:
    pass


async def for_anything_unannotated(message):
    pass


@pytest.mark.parametrize(
    "handler",
    [
        for_animals,
        for_dogs_or_nothing,
        for_animals_or_notes,
        for_anything,
        for_objects,
        for_an_alias_of_animals_or_notes,
        for_anything_unannotated,
    ],
    ids=lambda handler: handler.__name__,
)
def test_a_message_annotation_that_accepts_the_registered_type_is_accepted(
    handler: Any,
) -> None:
    app = App("vet")
    app.register(Dog, handler)

    assert app.handlers.has_handler(Dog)


def refusal(message_type: type, handler: Any) -> str:
    app = App("a")
    with pytest.raises(ConfigurationError) as raised:
        app.register(message_type, handler)
    return str(raised.value)


async def takes_nothing() -> None:
    pass


def test_a_function_taking_no_parameter_is_refused() -> None:
    assert refusal(Ping, takes_nothing) == (
        "takes_nothing takes no message: write `async def takes_nothing(message: Ping)`"
    )


async def takes_anything(*args: Any, **kwargs: Any) -> None:
    pass


def test_a_function_taking_only_args_and_kwargs_is_refused() -> None:
    assert refusal(Ping, takes_anything) == (
        "takes_anything takes no message, only *args/**kwargs: write `async def "
        "takes_anything(message: Ping)`, or, if it is a decorator's wrapper, decorate it with "
        "`@functools.wraps(handler)` so that the handler's own signature shows"
    )


async def handle_pong(msg: Pong) -> None:
    pass


def test_a_function_annotated_for_another_type_is_refused() -> None:
    assert refusal(Ping, handle_pong) == (
        "handle_pong is registered for Ping but its message parameter `msg` is annotated Pong: "
        "register it for Pong, or annotate `msg: Ping`"
    )


async def dogs_only(message: Dog) -> None:
    pass


def test_a_function_for_a_subclass_registered_for_its_base_is_refused() -> None:
    """A handler for Dog registered for Animal would be given cats too."""
    assert refusal(Animal, dogs_only) == (
        "dogs_only is registered for Animal but its message parameter `message` is annotated "
        "Dog: register it for Dog, or annotate `message: Animal`"
    )


async def pong_or_notify(msg: Pong | Notify) -> None:
    pass


def test_a_union_without_the_registered_type_is_refused() -> None:
    assert refusal(Ping, pong_or_notify) == (
        "pong_or_notify is registered for Ping but its message parameter `msg` is annotated "
        "Pong | Notify: annotate `msg: Ping`"
    )


async def numbers(msg: list[int]) -> None:
    pass


def test_a_generic_alias_as_message_annotation_is_refused() -> None:
    assert refusal(Ping, numbers) == (
        "numbers is registered for Ping but its message parameter `msg` is annotated list[int]: "
        "annotate `msg: Ping`"
    )


async def with_other(msg, other: int):
    pass


def test_a_function_with_a_parameter_nothing_fills_is_refused() -> None:
    assert refusal(Ping, with_other) == (
        "with_other's parameter `other: int` would receive nothing: a handler function takes "
        "the message and, if it wants, the context, e.g. `async def with_other(msg: Ping, "
        "context: MessageContext)`; take other dependencies in a handler class's __init__, bind "
        "it before registering (`functools.partial(handler, other=...)`), or give `other` a "
        "default"
    )


async def three_unannotated(message, context, extra):
    pass


def test_a_third_unannotated_parameter_is_refused() -> None:
    assert refusal(Ping, three_unannotated) == (
        "three_unannotated's parameter `extra` would receive nothing: a handler function takes "
        "the message and, if it wants, the context, e.g. `async def three_unannotated(message: "
        "Ping, context: MessageContext)`; take other dependencies in a handler class's "
        "__init__, bind it before registering (`functools.partial(handler, extra=...)`), or "
        "give `extra` a default"
    )


async def two_contexts(message: Ping, first: MessageContext, second: MessageContext) -> None:
    pass


def test_a_function_taking_the_context_twice_is_refused() -> None:
    assert refusal(Ping, two_contexts) == (
        "two_contexts takes the MessageContext twice (`first`, `second`): keep one"
    )


async def positional_only_after_a_default(
    message: Ping, note: str = "", context: MessageContext | None = None, /
) -> None:
    pass


def test_a_positional_only_context_after_a_skipped_parameter_is_refused() -> None:
    assert refusal(Ping, positional_only_after_a_default) == (
        "positional_only_after_a_default cannot be given `context`: it is positional-only and "
        "comes after `note`, which receives nothing; put it first"
    )


async def unreadable(message: "list[") -> None:  # noqa: F722
    pass


def test_an_annotation_that_cannot_be_read_is_refused() -> None:
    assert refusal(Ping, unreadable).startswith(
        "cannot read the type hints of unreadable (",
    )
    assert refusal(Ping, unreadable).endswith("): write each annotation as a Python expression")


async def unimported(message: "dataclass.Missing") -> None:
    pass


def test_an_annotation_naming_what_its_module_lacks_says_to_import_it() -> None:
    assert refusal(Ping, unimported) == (
        "cannot read the type hints of unimported ('function' object has no attribute "
        "'Missing'): import the annotated types at module level"
    )


PingAlias = NewType("PingAlias", Ping)


async def newtype_of_ping(message: PingAlias) -> None:
    pass


def test_a_newtype_annotation_is_named_as_written() -> None:
    assert refusal(Ping, newtype_of_ping) == (
        "newtype_of_ping is registered for Ping but its message parameter `message` is "
        "annotated PingAlias: annotate `message: Ping`"
    )


class Placing:
    async def place(self, message: PlaceOrder) -> None:
        pass


def test_a_method_taken_from_its_class_is_refused() -> None:
    assert refusal(PlaceOrder, Placing.place) == (
        "Placing.place is a method taken from its class, so its `self` would receive the "
        "message or its context: register an instance's method, `Placing(...).place`, or "
        "register Placing as a handler class with `async def __call__(self, message: "
        "PlaceOrder)`"
    )


async def test_a_string_annotation_of_a_local_handler_may_name_a_local_class() -> None:
    """The string is evaluated in the module, where PlaceOrder is another class."""

    @dataclass
    class PlaceOrder:
        order_id: str

    got: list[PlaceOrder] = []

    async def place(message: "PlaceOrder") -> None:
        got.append(message)

    app = App("orders")
    app.route(PlaceOrder, "orders")
    app.register(PlaceOrder, place)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1"))
        await bus.idle()

    assert got == [PlaceOrder("o-1")]


class PongHandler:
    async def __call__(self, message: Pong) -> None:
        pass


def test_a_handler_class_annotated_for_another_type_is_refused() -> None:
    assert refusal(Ping, PongHandler) == (
        "PongHandler is registered for Ping but its message parameter `message` is annotated "
        "Pong: register it for Pong, or annotate `message: Ping`"
    )


class CallTakesNothing:
    async def __call__(self) -> None:
        pass


def test_a_handler_class_whose_call_takes_no_message_is_refused() -> None:
    assert refusal(Ping, CallTakesNothing) == (
        "CallTakesNothing.__call__ takes no message: write `async def __call__(self, message: "
        "Ping)`"
    )


class CallTakesContext:
    async def __call__(self, message: Ping, context: MessageContext) -> None:
        pass


def test_a_handler_class_whose_call_takes_more_than_the_message_is_refused() -> None:
    assert refusal(Ping, CallTakesContext) == (
        "CallTakesContext.__call__'s parameter `context: MessageContext` would receive nothing: "
        "write `async def __call__(self, message: Ping)` and take the context and other "
        "dependencies in CallTakesContext.__init__"
    )


class PongObject:
    async def __call__(self, msg: Pong) -> None:
        pass


def test_an_async_callable_object_annotated_for_another_type_is_refused() -> None:
    assert refusal(Ping, PongObject()) == (
        "PongObject instance is registered for Ping but its message parameter `msg` is "
        "annotated Pong: register it for Pong, or annotate `msg: Ping`"
    )


def not_async(message: Ping) -> None:
    pass


async def yields(message: Ping) -> Any:
    yield message


class SyncCall:
    def __call__(self, message: Ping) -> None:
        pass


def test_what_is_not_an_async_handler_is_refused_with_the_form_to_write() -> None:
    assert (
        refusal(Ping, not_async)
        == "not_async is not async: write `async def not_async(message: Ping)`"
    )
    assert refusal(Ping, yields) == (
        "yields is an async generator (it yields): write `async def yields(message: Ping)`"
    )
    assert refusal(Ping, SyncCall) == (
        "handler class SyncCall needs an `async def __call__(self, message: Ping)`"
    )
    assert refusal(Ping, SyncCall()) == (
        "SyncCall instance is not a handler: register a class with `async def __call__(self, "
        "message: Ping)` or an `async def` function taking the message"
    )
    assert refusal(Ping, "handle") == (
        "'handle' is not a handler: register a class with `async def __call__(self, message: "
        "Ping)` or an `async def` function taking the message"
    )


async def test_a_message_no_handler_takes_is_dead_lettered_at_once_not_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = orders_app()  # routes PlaceOrder to its own queue, registers nothing for it
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app) as bus:
            await app.send(PlaceOrder("o-1", 1.0))
            await bus.idle()

    assert (
        "app 'orders' routes PlaceOrder to its own queue but has no handler for it: every "
        "PlaceOrder it receives is dead-lettered (NoHandler); app.register(PlaceOrder, handler), "
        "or route PlaceOrder to the app that handles it"
    ) in caplog.messages
    [dead] = bus.dead_lettered
    assert dead.message == PlaceOrder("o-1", 1.0)
    assert dead.headers["error-type"] == "mersal.errors.NoHandler"
    assert dead.headers["error-message"] == (
        "no handler for PlaceOrder in this app: app.register(PlaceOrder, handler), or route "
        "PlaceOrder to the app that handles it"
    )
    assert dead.headers["error-attempts"] == "1"


async def test_a_reply_to_its_own_send_that_no_handler_takes_names_request() -> None:
    app = orders_app()

    async def accept(message: PlaceOrder) -> None:
        await app.reply(OrderAccepted(message.order_id))

    app.register(PlaceOrder, accept)
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 1.0))  # reply-to: the app's own queue
        await bus.idle()

    [dead] = bus.dead_lettered
    assert dead.message == OrderAccepted("o-1")
    assert dead.headers["error-type"] == "mersal.errors.NoHandler"
    assert dead.headers["error-message"] == (
        "no handler for OrderAccepted, a reply, in this app: a reply to a message sent with send "
        "comes to the sender's own queue; app.register(OrderAccepted, handler), or send with "
        "app.request(...) to await the reply"
    )


async def test_a_route_home_whose_subclasses_are_handled_is_not_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = orders_app()
    app.register(RushOrder, handle_rush)
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app) as bus:
            await app.send(RushOrder("o-1", 1.0))
            await bus.idle()

    assert not [m for m in caplog.messages if "has no handler" in m]
    assert rushed == [RushOrder("o-1", 1.0)]
    assert bus.dead_lettered == []


@dataclass
class RushOrder(PlaceOrder):
    pass


rushed: list[PlaceOrder] = []


async def handle_rush(message: RushOrder) -> None:
    rushed.append(message)


def test_register_with_its_arguments_swapped_says_so() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("orders").register(handle_rush, RushOrder)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "app.register() takes the message class first, then the handler: "
        "app.register(RushOrder, handle_rush)"
    )


class RushHandler:
    async def __call__(self, message: RushOrder) -> None:
        rushed.append(message)


class SyncRushHandler:
    def __call__(self, message: RushOrder) -> None:
        rushed.append(message)


@pytest.mark.parametrize("handler", [RushHandler, SyncRushHandler])
def test_register_with_a_handler_class_first_says_the_arguments_are_swapped(
    handler: type,
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("orders").register(handler, RushOrder)
    assert str(raised.value) == (
        "app.register() takes the message class first, then the handler: "
        f"app.register(RushOrder, {handler.__qualname__})"
    )


def test_register_with_a_message_instance_says_to_pass_the_class() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("orders").register(RushOrder("o-1", 2), RushHandler)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "app.register() takes a message class, not RushOrder(order_id='o-1', amount=2): "
        "pass the class itself"
    )


class SessionHandler:
    """Asks for the message's session, as the design's sample handler does."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class Orders:
    """A repository on the message's session."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session


class RepositoryHandler:
    def __init__(self, orders: Orders) -> None:
        self.orders = orders

    async def __call__(self, message: PlaceOrder) -> None:
        pass


# A handler needing the message's database session on an app without a database.


@pytest.mark.parametrize(
    ("handler", "trail"),
    [
        (SessionHandler, "session: AsyncSession"),
        (RepositoryHandler, "orders: Orders -> session: AsyncSession"),
    ],
)
async def test_a_handler_asking_for_a_session_without_a_database_is_told_to_pass_one(
    handler: type, trail: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    app = App("orders")
    app.register(PlaceOrder, handler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        f"handler {handler.__qualname__} needs {trail}, the message's database session, but "
        "the app has no database: pass App(database='postgresql+asyncpg://...') (or set "
        "MERSAL_DATABASE), or drop the session from the handler"
    )
    assert not app.running


async def test_a_session_bound_in_the_users_container_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lagom import Container

    monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    container = Container()
    container[AsyncSession] = lambda: None  # type: ignore[assignment,return-value]
    app = App("orders", container=container)
    app.register(PlaceOrder, SessionHandler)
    async with Harness(app):
        assert app.running


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


async def noop(message: object) -> None:
    pass


class SyncSessionHandler:
    def __init__(self, session: Session) -> None:
        self.session = session

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class LabelledHandler:
    def __init__(self, label: str) -> None:
        self.label = label

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class Unresolvable:
    """A library's class whose constructor's hints name what its module does not import."""

    def __init__(self, mapper: "Mapper") -> None:  # noqa: F821
        self.mapper = mapper


class UnresolvableHandler:
    def __init__(self, thing: Unresolvable) -> None:
        self.thing = thing

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class Unhinted:
    """A library's class whose constructor's parameters carry no type hints."""

    def __init__(self, url, timeout=5.0) -> None:  # type: ignore[no-untyped-def]
        self.url = url


class UnhintedHandler:
    def __init__(self, client: Unhinted) -> None:
        self.client = client

    async def __call__(self, message: PlaceOrder) -> None:
        pass


# Handlers whose dependencies or form cannot work, refused with what to change.


@pytest.mark.parametrize(
    ("handler", "told"),
    [
        pytest.param(
            ChargeHandler,
            (
                "handler ChargeHandler needs gateway: PaymentGateway -> url: str, and a str "
                "cannot be injected by its type: give `url` a default, or bind PaymentGateway in "
                "the lagom Container passed as App(container=...), e.g. "
                "container[PaymentGateway] = PaymentGateway(...)"
            ),
            id="unprovided-type",
        ),
        pytest.param(
            SyncSessionHandler,
            (
                "handler SyncSessionHandler needs session: Session, SQLAlchemy's synchronous "
                "session, which Mersal does not provide: ask for the message's "
                "sqlalchemy.ext.asyncio.AsyncSession instead"
            ),
            id="sync-session",
        ),
        pytest.param(
            LabelledHandler,
            (
                "handler LabelledHandler needs label: str, and a str cannot be injected by its "
                "type: give `label` a default, or register an instance, LabelledHandler(...), in "
                "place of the class"
            ),
            id="str-itself",
        ),
        pytest.param(
            UnresolvableHandler,
            (
                "handler UnresolvableHandler needs thing: Unresolvable, which nobody provides "
                "(nor can it be built: Unresolvable.__init__'s type hints do not resolve): bind "
                "it in the lagom Container passed as App(container=...), e.g. "
                "container[Unresolvable] = ..."
            ),
            id="hints-unresolved",
        ),
        pytest.param(
            UnhintedHandler,
            (
                "handler UnhintedHandler needs client: Unhinted, which nobody provides (nor can "
                "it be built: Unhinted.__init__'s parameter 'url' has no type hint): bind it in "
                "the lagom Container passed as App(container=...), e.g. container[Unhinted] = ..."
            ),
            id="no-type-hints",
        ),
    ],
)
async def test_a_handler_whose_dependencies_cannot_be_provided_fails_at_start_saying_what_to_do(
    handler: type, told: str
) -> None:
    app = App("billing")
    app.register(PlaceOrder, handler)  # registering is fine; start() checks
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == told
    assert not app.running


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
        await app.send(PlaceOrder("o-1", 10.0))
        await bus.idle()
    assert got == ["eu"]


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


class Writes:
    """A dependency that writes through a session."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session


class Service:
    """A dependency of a dependency that writes."""

    def __init__(self, writes: Writes) -> None:
        self.writes = writes


class ServiceHandler:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class PlainHandler:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, message: Notify) -> None:
        pass


class BoundHandler:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def __call__(self, message: OrderAccepted) -> None:
        pass


def _is_session(dependency: object) -> bool:
    return dependency is AsyncSession


def test_what_a_message_types_handlers_need_is_read_through_their_dependencies() -> None:
    container = Container()
    container[Service] = lambda: Service(Writes(AsyncMock()))  # a factory: not looked into
    handlers = mersal.handlers.Handlers(container)
    handlers.add(PlaceOrder, ServiceHandler)
    handlers.add(Notify, PlainHandler)

    async def noted(message: Notify) -> None:
        pass

    handlers.add(Notify, noted, builds=(Writes,))
    handlers.add(OrderAccepted, BoundHandler)
    unbound = mersal.handlers.Handlers(None)
    unbound.add(PlaceOrder, ServiceHandler)

    assert handlers.needs(Notify, _is_session)  # through the class the function builds
    assert not handlers.needs(OrderAccepted, _is_session)  # the container gives its Service
    assert not handlers.needs(PlaceOrder, _is_session)  # the same bound Service
    assert unbound.needs(PlaceOrder, _is_session)  # Service -> Writes -> AsyncSession
    assert not unbound.needs(Notify, _is_session)  # no handler at all
