"""Subscriptions on RabbitMQ across releases: a start binds what the app subscribes to, only."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import pytest

from mersal import App, RetryPolicy, message
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.management import Management
from mersal_rabbitmq.topology import EVENTS
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration


@message("tests.mersal_rabbitmq.Shipped.v1")
@dataclass
class Shipped:
    parcel: str


@message("tests.mersal_rabbitmq.Cancelled.v1")
@dataclass
class Cancelled:
    parcel: str


SHIPPED = "tests.mersal_rabbitmq.Shipped.v1"
CANCELLED = "tests.mersal_rabbitmq.Cancelled.v1"


async def ignore(event: object) -> None:
    return None


def release(name: str, url: str, broker: Broker, *events: type) -> App:
    """The app `name` as a release that subscribes to `events`; its queues deleted after."""
    app = App(name, transport=url, retry=RetryPolicy(error_queue=f"{name}.error"))
    assert isinstance(app.transport, RabbitMQTransport)
    broker.watch(app)
    for event in events:
        app.register(event, ignore)
        app.subscribe(event)
    return app


async def ready_messages(broker: Broker, queue: str) -> int:
    """The messages ready in `queue`."""
    declared = await broker.channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def test_a_start_unbinds_the_events_its_release_no_longer_subscribes_to(
    url: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"{prefix}.shipping"
    async with release(name, url, broker, Shipped, Cancelled):
        pass
    audit = await broker.channel.declare_exchange(f"{prefix}.audit", auto_delete=True)
    queue = await broker.channel.get_queue(name, ensure=False)
    await queue.bind(audit, CANCELLED)  # the user's own binding, from another exchange
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")

    async with release(name, url, broker, Shipped):
        pass
    sender = App(f"{prefix}.sender", transport=url, consume=False)
    async with sender:
        await sender.publish(Cancelled("p-1"))
        await sender.publish(Shipped("p-2"))

    assert await ready_messages(broker, name) == 1  # Shipped; Cancelled no longer arrives
    bound = await Management.of(url).bindings(name)
    assert (EVENTS, CANCELLED) not in bound
    assert (EVENTS, SHIPPED) in bound
    assert (f"{prefix}.audit", CANCELLED) in bound
    unbound = [r for r in caplog.records if r.levelno == logging.INFO and "unbound" in r.message]
    assert len(unbound) == 1 and CANCELLED in unbound[0].message and name in unbound[0].message
    await queue.unbind(audit, CANCELLED)


async def test_a_start_leaves_events_bindings_that_mersal_does_not_make(
    url: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"{prefix}.shipping"
    async with release(name, url, broker, Shipped):
        pass
    events = await broker.channel.get_exchange(EVENTS)
    queue = await broker.channel.get_queue(name, ensure=False)
    await queue.bind(events, "audit.#")  # the user's own, with a wildcard
    await queue.bind(events, CANCELLED, arguments={"x-note": "kept by ops"})
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")

    async with release(name, url, broker, Shipped):
        pass

    bound = await Management.of(url).bindings(name)
    assert (EVENTS, "audit.#") in bound and (EVENTS, CANCELLED) in bound
    assert not [r for r in caplog.records if "unbound" in r.message]
    await queue.unbind(events, "audit.#")
    await queue.unbind(events, CANCELLED, arguments={"x-note": "kept by ops"})


async def test_a_publish_after_the_events_exchange_was_deleted_declares_it_again_and_goes(
    url: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"{prefix}.shipping"
    app = release(name, url, broker)
    got: list[str] = []

    async def handle(event: Shipped) -> None:
        got.append(event.parcel)

    app.register(Shipped, handle)
    app.subscribe(Shipped)
    async with app:
        await app.publish(Shipped("p-1"))
        await eventually(lambda: got == ["p-1"], "the first event handled")
        await broker.channel.exchange_delete(EVENTS)
        await app.publish(Shipped("p-2"))  # not refused: sent again to the exchange made again
        await eventually(lambda: got == ["p-1", "p-2"], "the app's own binding back")
    assert any("declared it again" in r.message for r in caplog.records)


async def test_without_the_management_api_a_start_says_how_to_remove_old_bindings(
    url: str,
    broker: Broker,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"{prefix}.shipping"
    async with release(name, url, broker, Shipped, Cancelled):
        pass
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    silent = Management(f"http://127.0.0.1:{closed}", "/", "guest", "guest")
    monkeypatch.setattr(Management, "of", classmethod(lambda cls, *args, **kwargs: silent))
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")

    async with release(name, url, broker, Shipped):
        pass

    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"cannot list the bindings of queue {name!r}" in warnings[0]
    assert "rabbitmq-plugins enable rabbitmq_management" in warnings[0]
    assert "rabbitmqctl list_bindings" in warnings[0] and SHIPPED in warnings[0]
    async with App(f"{prefix}.sender", transport=url, consume=False) as sender:
        await sender.publish(Cancelled("p-3"))
    assert await ready_messages(broker, name) == 1  # the old binding stays, as the line says
