"""Request/reply (app.request): a reply that cannot be built fails its request, not the app;
a stop fails a pending request at once."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    ConfigurationError,
    DecodeError,
    Header,
    MessageContext,
    NotRunning,
    RequestTimeout,
    RetryPolicy,
    message,
)
from tests.mersal.support import CountingTransport, assert_settled, in_queue, qualified, quiet
from tests.support import eventually, unique

pytestmark = pytest.mark.timeout(60)


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Ask:
    n: int


@message("settle.Answer")
@dataclass
class Answer:
    """The requester's reply class: a negative answer cannot be built."""

    n: int

    def __post_init__(self) -> None:
        if self.n == -2:
            raise asyncio.CancelledError()
        if self.n == -3:
            raise KeyboardInterrupt()
        if self.n < 0:
            raise RuntimeError(f"an answer cannot be negative ({self.n})")


@message("settle.Answer")
@dataclass
class AnswerOut:
    """The replier's class for the same wire name, which builds any answer."""

    n: int


@pytest.mark.parametrize(
    ("n", "raised", "text"),
    [
        pytest.param(-1, RuntimeError, "cannot be negative", id="RuntimeError"),
        pytest.param(
            -2,
            asyncio.CancelledError,
            "",
            id="CancelledError",
        ),
        pytest.param(-3, KeyboardInterrupt, "", id="KeyboardInterrupt"),
    ],
)
async def test_a_reply_that_cannot_be_built_fails_its_request_and_later_requests_work(
    memory_url: str, n: int, raised: type[BaseException], text: str
) -> None:
    async def answer(message: Ask, context: MessageContext) -> None:
        await context.app.reply(AnswerOut(message.n))

    client = App("client", transport=memory_url, retry=POLICY)
    client.route(Ask, "server")
    server = App("server", transport=memory_url, retry=POLICY)
    server.register(Ask, answer)
    async with server, client:
        broker = client.transport.broker  # type: ignore[attr-defined]
        began = time.monotonic()
        with pytest.raises(DecodeError):
            await client.request(Ask(n), reply_type=Answer, timeout=3)
        assert time.monotonic() - began < 2.0
        assert await client.request(Ask(2), reply_type=Answer, timeout=2) == Answer(2)
        assert await client.request(Ask(3), reply_type=Answer, timeout=2) == Answer(3)
        await eventually(
            lambda: len(broker.queues["error"]) == 1, "the bad reply in the error queue", timeout=5
        )
        [dead] = in_queue(broker, "error")
        [replies] = [name for name in broker.queues if name.startswith("client.replies.")]
        await quiet(broker, client)
        assert_settled(broker, replies)
    assert dead.headers[Header.ERROR_QUEUE] == replies
    assert dead.headers[Header.ERROR_TYPE] == qualified(raised)
    assert text in dead.headers[Header.ERROR_MESSAGE]
    assert dead.body == f'{{"n":{n}}}'.encode()


async def test_stop_fails_a_pending_request_promptly_with_not_running(memory_url: str) -> None:
    client = App("client", transport=memory_url)
    client.route(Ask, "void")
    await client.start()
    try:
        await client.transport.declare("void")  # nobody consumes it: no reply will come
        void = client.transport.broker.queues["void"]  # type: ignore[attr-defined]
        request = asyncio.create_task(client.request(Ask(1), reply_type=Answer, timeout=30))
        await eventually(lambda: len(void) == 1, "the request waiting in its queue for a reply")
        assert not request.done()
    finally:
        began = time.monotonic()
        await client.stop()
    with pytest.raises(NotRunning):
        async with asyncio.timeout(2):
            await request
    assert time.monotonic() - began < 2.0


@dataclass
class Question:
    n: int


@dataclass
class Reply:
    n: int


def test_requests_at_once_work_in_each_event_loop_the_app_runs_in(amqp_url: str) -> None:
    """An app started again in another loop (pytest's loop per test, say) opens its reply
    queue again in that loop, many requests at once."""
    server = App(unique("replier"), transport=amqp_url)
    client = App(unique("requester"), transport=amqp_url)

    async def answer(message: Question, context: MessageContext) -> None:
        await context.app.reply(Reply(message.n))

    server.register(Question, answer)
    client.route(Question, server.name)

    async def ask() -> list[int]:
        async with server, client:
            replies = await asyncio.gather(
                *(client.request(Question(n), timeout=20, reply_type=Reply) for n in range(3))
            )
        return [reply.n for reply in replies]

    assert asyncio.run(ask()) == [0, 1, 2]
    assert asyncio.run(ask()) == [0, 1, 2]


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5", True])
async def test_a_request_timeout_that_is_not_seconds_above_zero_is_refused(
    timeout: object, memory_url: str
) -> None:
    app = App("asking", transport=memory_url)
    app.route(Question, "elsewhere")
    async with app:
        with pytest.raises(ConfigurationError) as refused:
            await app.request(Question(1), timeout=timeout)  # type: ignore[arg-type]

    assert str(refused.value).startswith(f"request(timeout={timeout!r}): give the seconds")


async def test_each_reply_is_settled_once_whether_awaited_late_or_bad(memory_url: str) -> None:
    late = asyncio.Event()

    async def answer(message: Ask, context: MessageContext) -> None:
        if message.n == 99:
            await late.wait()
        await context.app.reply(AnswerOut(message.n))

    transport = CountingTransport(memory_url)
    client = App("client", transport=transport, retry=POLICY)
    client.route(Ask, "server")
    server = App("server", transport=memory_url, retry=POLICY)
    server.register(Ask, answer)
    async with server, client:
        broker = transport.broker
        assert await client.request(Ask(1), reply_type=Answer, timeout=5) == Answer(1)
        with pytest.raises(DecodeError):
            await client.request(Ask(-1), reply_type=Answer, timeout=5)
        with pytest.raises(RequestTimeout):
            await client.request(Ask(99), reply_type=Answer, timeout=0.05)
        late.set()
        [replies] = [name for name in broker.queues if name.startswith("client.replies.")]
        await eventually(
            lambda: len(transport.settles(replies)) == 3, "three replies settled", timeout=5
        )
        await quiet(broker, client)
        assert_settled(broker, replies)
        assert [e.headers[Header.ERROR_QUEUE] for e in in_queue(broker, "error")] == [replies]
        assert transport.settles(replies) == [["ack"]] * 3
