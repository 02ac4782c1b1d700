"""The transport limits (mersal/transport/limits.py) are checked where they are set: a retry
delay or defer the transport cannot hold, headers, partition keys and reply addresses the broker
cannot carry are refused at start or at the call, not when the broker closes a channel."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import mersal.transport.limits
from mersal import (
    App,
    ConfigurationError,
    Header,
    MessageContext,
    RetryPolicy,
    Unsendable,
    message,
)
from mersal.testing import Harness
from tests.mersal.support import assert_settled

pytestmark = pytest.mark.timeout(60)


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Job:
    n: int


@dataclass
class Out:
    text: str


@dataclass
class Ask:
    n: int


@message("settle.Answer")
@dataclass
class AnswerOut:
    """The replier's class for the same wire name, which builds any answer."""

    n: int


async def _succeed(message: Job) -> None:
    return None


BAD_HEADERS = [
    pytest.param({"n": 1}, id="value-not-str"),
    pytest.param({1: "x"}, id="name-not-str"),
    pytest.param({"CC": "ops@example.com"}, id="CC"),
    pytest.param({"BCC": "ops@example.com"}, id="BCC"),
    pytest.param({"x" * 129: "v"}, id="name-129-bytes"),
    pytest.param({"é" * 65: "v"}, id="name-130-utf8-bytes"),
    pytest.param({"big": "x" * 131_072}, id="value-over-size"),
    pytest.param({str(i): "" for i in range(20_000)}, id="many-headers-over-size"),
    pytest.param({"s": "\ud800"}, id="surrogate-value"),
    pytest.param({"\udc80": "v"}, id="surrogate-name"),
]


Send = Callable[[App, object, Any], Awaitable[str]]


CALLS: dict[str, Send] = {
    "send": lambda app, body, headers: app.send(body, headers=headers),
    "send_local": lambda app, body, headers: app.send_local(body, headers=headers),
    "publish": lambda app, body, headers: app.publish(body, headers=headers),
    "defer": lambda app, body, headers: app.defer(0.01, body, headers=headers),
}


def strict_app(received: list[str]) -> App:
    """An app that routes, subscribes to and handles Out itself."""

    async def record(message: Out) -> None:
        received.append(message.text)

    app = App("strict", retry=POLICY)
    app.register(Out, record)
    app.route(Out, "strict")
    app.subscribe(Out)
    return app


async def test_a_retry_delay_longer_than_the_transport_holds_fails_at_start(
    memory_url: str,
) -> None:
    app = App("limits", transport=memory_url, retry=RetryPolicy(delayed=[10**7]))
    app.register(Job, _succeed)
    limit = f"{mersal.transport.limits.DEFAULT_LIMITS.max_delay:.0f}"
    with pytest.raises(ConfigurationError, match=limit):
        await app.start()
    assert not app.running


async def test_a_defer_longer_than_the_transport_holds_is_refused_at_the_call() -> None:
    app = App("limits")
    app.register(Job, _succeed)
    async with Harness(app) as bus:
        with pytest.raises(Unsendable, match="4200000"):
            await app.defer(10**7, Job(1))
        assert bus.broker.delayed == 0
        assert bus.deferred == [] and bus.sent == []
        await app.defer(0.01, Job(2))
        await bus.idle(timeout=5)
    assert [r.message for r in bus.deferred] == [Job(2)]


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("headers", BAD_HEADERS)
async def test_headers_the_broker_cannot_carry_are_refused_at_the_call(
    call: str, headers: dict[Any, Any]
) -> None:
    received: list[str] = []
    app = strict_app(received)
    async with Harness(app) as bus:
        with pytest.raises(Unsendable):
            await CALLS[call](app, Out("bad"), headers)
        assert (bus.sent, bus.published, bus.deferred) == ([], [], [])
        await CALLS[call](app, Out("good"), None)
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "strict")
    assert received == ["good"]
    assert bus.dead_lettered == []


@pytest.mark.parametrize("headers", BAD_HEADERS)
async def test_a_reply_with_headers_the_broker_cannot_carry_is_refused_at_the_call(
    headers: dict[Any, Any],
) -> None:
    received: list[str] = []
    refused: list[BaseException] = []
    app = strict_app(received)

    async def ask(message: Ask, context: MessageContext) -> None:
        try:
            await context.app.reply(Out("bad"), headers=headers)
        except Exception as error:
            refused.append(error)
        await context.app.reply(Out("good"))

    app.register(Ask, ask)
    async with Harness(app) as bus:
        await app.send_local(Ask(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "strict")
    assert [type(error) for error in refused] == [Unsendable]
    assert bus.sent_of(Out) == [Out("good")]
    assert received == ["good"]
    assert bus.dead_lettered == []


@pytest.mark.parametrize("headers", BAD_HEADERS)
async def test_a_request_with_headers_the_broker_cannot_carry_is_refused_at_once(
    headers: dict[Any, Any],
) -> None:
    async def answer(message: Ask, context: MessageContext) -> None:
        await context.app.reply(AnswerOut(message.n))

    app = App("strict", retry=POLICY)
    app.register(Ask, answer)
    app.route(Ask, "strict")
    async with Harness(app) as bus:
        began = time.monotonic()
        with pytest.raises(Unsendable):
            await app.request(Ask(1), reply_type=AnswerOut, timeout=5, headers=headers)
        assert time.monotonic() - began < 1.0
        assert bus.sent == []
        assert await app.request(Ask(2), reply_type=AnswerOut, timeout=5) == AnswerOut(2)
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "strict")
    assert bus.dead_lettered == []


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_a_partition_key_that_cannot_travel_is_refused_at_the_call(call: str) -> None:
    received: list[str] = []
    app = strict_app(received)
    async with Harness(app) as bus:
        with pytest.raises(Unsendable):
            await CALLS[call](app, Out("bad"), {Header.PARTITION_KEY: "key-\ud800"})
        assert (bus.sent, bus.published, bus.deferred) == ([], [], [])
        await CALLS[call](app, Out("good"), {Header.PARTITION_KEY: "key-1"})
        await bus.idle(timeout=5)
    assert received == ["good"]


async def test_a_reply_to_an_address_over_255_bytes_is_refused_at_the_call() -> None:
    received: list[str] = []
    refused: list[BaseException] = []
    app = strict_app(received)

    async def ask(message: Ask, context: MessageContext) -> None:
        try:
            await context.app.reply(Out("to nowhere"))
        except Exception as error:
            refused.append(error)
        await context.app.send_local(Out("good"))

    app.register(Ask, ask)
    async with Harness(app) as bus:
        await app.send_local(Ask(1), headers={Header.REPLY_TO: "r" * 300})
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "strict")
    [error] = refused
    assert isinstance(error, Unsendable)
    assert "255" in str(error)
    assert bus.sent_of(Out) == [Out("good")]
    assert received == ["good"]
