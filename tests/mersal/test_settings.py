"""The app's settings (mersal/settings.py): names from configuration checked when given (app
names, routes, the error queue), and the whole app checked at start (a handled type that no
route to this app's queue and no subscription brings is warned of, naming what to add)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from mersal import App, ConfigurationError, RetryPolicy
from mersal.testing import Harness


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class Animal:
    name: str


@dataclass
class Dog(Animal):
    breed: str


async def noop(message: object) -> None:
    pass


UNDELIVERED = (
    "app 'billing' handles PlaceOrder but neither routes it to its own queue nor subscribes to "
    "it: its handler runs only for a PlaceOrder sent with send_local, routed here by another "
    "app or replied to this app; app.route(PlaceOrder, 'billing') if this app receives it, "
    "app.subscribe(PlaceOrder) if it is a published event"
)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mersal.app" and r.levelno == logging.WARNING
    ]


async def test_a_handled_type_neither_routed_here_nor_subscribed_is_warned_of_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("billing")
    app.register(PlaceOrder, noop)
    app.route(PlaceOrder, "orders")  # routed, but elsewhere
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == [UNDELIVERED]


@pytest.mark.parametrize(
    "configure",
    [
        pytest.param(lambda app: app.route(PlaceOrder, "billing"), id="routed-here"),
        pytest.param(lambda app: app.subscribe(PlaceOrder), id="subscribed"),
    ],
)
async def test_a_handled_type_routed_here_or_subscribed_is_not_warned_of(
    configure: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("billing")
    app.register(PlaceOrder, noop)
    configure(app)
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "configure",
    [
        pytest.param(lambda app: app.subscribe(Dog), id="a-subclass-subscribed"),
        pytest.param(lambda app: app.route(Dog, "vet"), id="a-subclass-routed-here"),
        pytest.param(lambda app: app.route(Animal, "vet"), id="a-base-routed-here"),
    ],
)
async def test_a_handled_type_reached_through_a_related_class_is_not_warned_of(
    configure: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("vet")
    app.register(Animal, noop)  # a Dog is an Animal: Dog messages reach this handler
    app.register(Dog, noop)  # a route for Animal covers Dog
    configure(app)
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == []


# Names, concurrency and subscriptions checked where they are given or at start.


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


def test_an_invalid_concurrency_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        App("a", concurrency=0)


WRONG_KIND = [
    ({"grace_period": -1}, "App(grace_period=-1) must be a number of seconds >= 0"),
    ({"grace_period": "30"}, "App(grace_period='30') must be a number of seconds >= 0"),
    ({"grace_period": math.nan}, "App(grace_period=nan) must be a number of seconds >= 0"),
    ({"max_body_size": -1}, "App(max_body_size=-1) must be a number of bytes"),
    ({"max_body_size": "1MB"}, "App(max_body_size='1MB') must be a number of bytes"),
    ({"max_body_size": 1.5}, "App(max_body_size=1.5) must be a number of bytes"),
    ({"consume": "no"}, "App(consume='no') must be True"),
    ({"container": "x"}, "App(container='x') must be a lagom.Container"),
    ({"retry": "x"}, "App(retry='x') must be a mersal.RetryPolicy"),
    ({"codec": "json"}, "App(codec='json') must be a codec with encode() and decode()"),
    ({"database": 123}, "App(database=123) must be a SQLAlchemy URL"),
    ({"transport": 5}, "transport=5 is neither a URL"),
    ({"transport": "amqp://u:p@[::1/vh"}, "'amqp://u:***@[::1/vh' in transport"),
]


@pytest.mark.parametrize(("options", "said"), WRONG_KIND, ids=[str(o) for o, _ in WRONG_KIND])
def test_a_setting_of_the_wrong_kind_is_refused_saying_what_to_give(
    options: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        App("orders", **options)

    assert str(refused.value).startswith(said)


# Names from configuration.

HOSTILE = [
    "",
    " ",
    "orders ",
    " orders",
    "or ders",
    "orders\n",
    "\norders",
    "orders\r\nx-injected: 1",
    "orders\t",
    "../",
    "../orders",
    "./orders",
    "..",
    ".",
    "/orders",
    "-orders",
    "x" * 201,
    "x" * 300,
    "orders\x00",
    "\x00",
    "ord\x00ers",
    "\u043erders",  # a Cyrillic o
    "orders\u202e",
    "orders*",
    "orders.#",
    "orders;rm -rf",
    "orders?x=1",
    "orders%2F",
    None,
    42,
    b"orders",
]
FINE = ["orders", "orders.v1", "billing:in", "team/orders", "a-b_c", "0", "x" * 200]


def as_app_name(name: object) -> str:
    return App(name).name  # type: ignore[arg-type]


def as_route(name: object) -> str:
    app = App("orders")
    app.route(PlaceOrder, name)  # type: ignore[arg-type]
    return app.queue_for(PlaceOrder)


def as_error_queue(name: object) -> str:
    policy = RetryPolicy(error_queue=name)  # type: ignore[arg-type]
    return App("shipping", retry=policy).retry.error_queue


def test_the_error_queue_may_not_be_the_app_s_own_queue() -> None:
    with pytest.raises(ConfigurationError, match="the app's own queue"):
        App("orders", retry=RetryPolicy(error_queue="orders"))


USES: dict[str, Callable[[object], str]] = {
    "app name": as_app_name,
    "route": as_route,
    "error queue": as_error_queue,
}


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("name", HOSTILE, ids=repr)
def test_a_hostile_name_is_a_configuration_error(use: str, name: object) -> None:
    with pytest.raises(ConfigurationError) as raised:
        USES[use](name)

    text = str(raised.value)
    assert "queue" in text  # it says what the name is for
    assert not any(character in text for character in "\n\r\x00\u202e")  # shown escaped


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("name", FINE)
def test_an_ordinary_name_is_accepted(use: str, name: str) -> None:
    assert USES[use](name) == name
