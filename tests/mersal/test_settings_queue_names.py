"""Names from configuration are checked when given: app names, routes and the error queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mersal import App, ConfigurationError, RetryPolicy


@dataclass
class PlaceOrder:
    order_id: str


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
