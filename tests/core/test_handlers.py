"""Handlers: class handlers with injected dependencies, function handlers, order, failures."""

from dataclasses import dataclass
from typing import Any

from lagom import Container, Singleton

from mersal import App, MessageContext, RetryPolicy
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
