"""Receiving (mersal/receiving.py): each attempt of a delivery ends in one outcome.

Retries immediate and delayed, then the error queue; fail-fast exceptions after one call; an
undecodable delivery straight to the error queue; a step of the pipeline that raises, returns
without calling on or decides an outcome itself; whatever a handler raises (BaseException,
cancellation, an exception that cannot be printed, a hang) counts as one attempt.
"""

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    Envelope,
    Header,
    MessageContext,
    RetryPolicy,
)
from mersal.errors import Duplicate
from mersal.pipeline import HandlerTimeout, Next
from mersal.settle import ACK, ERROR_HEADERS
from mersal.testing import Harness
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from tests.mersal.support import (
    ERROR_QUEUE,
    assert_settled,
    broker_of,
    dead_lettered,
    in_queue,
    qualified,
)
from tests.support import eventually


@dataclass
class Charge:
    order_id: str
    amount: float


@dataclass
class Ping:
    n: int


class PaymentGatewayDown(Exception):
    """A failure the handler raises."""


class InvalidCard(ValueError):
    """A failure that retrying cannot fix (a ValueError subclass)."""


def charge_the_card(message: Charge) -> None:
    raise PaymentGatewayDown(f"gateway refused {message.order_id}")


def warnings_about(caplog: pytest.LogCaptureFixture, message_id: str) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.levelno >= logging.WARNING and message_id in record.getMessage()
    ]


async def test_an_always_failing_message_is_tried_five_times_then_dead_lettered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempts: list[int] = []

    async def handle(message: Charge, context: MessageContext) -> None:
        attempts.append(context.attempt)
        charge_the_card(message)

    app = App("billing", retry=RetryPolicy(immediate=2, delayed=[0.05, 0.05], error_queue="errors"))
    app.route(Charge, "billing")
    app.register(Charge, handle)
    async with Harness(app) as bus:
        message_id = await app.send(Charge("o-1", 9.5), headers={"tenant": "acme"})
        await bus.idle()
        errors = bus.broker.queues["errors"]
        in_error_queue = [stored.envelope for stored in errors.ready]

    assert attempts == [1, 2, 3, 4, 5]

    [original] = bus.sent
    [envelope] = in_error_queue
    assert json.loads(envelope.body) == {"order_id": "o-1", "amount": 9.5}
    headers = envelope.headers
    for name, value in original.headers.items():
        assert headers[name] == value, name
    assert headers["tenant"] == "acme"
    qualified = f"{PaymentGatewayDown.__module__}.PaymentGatewayDown"
    assert headers[Header.ERROR_TYPE] == qualified
    assert headers[Header.ERROR_MESSAGE] == "gateway refused o-1"
    assert "charge_the_card" in headers[Header.ERROR_TRACEBACK]
    assert "PaymentGatewayDown: gateway refused o-1" in headers[Header.ERROR_TRACEBACK]
    assert headers[Header.ERROR_ATTEMPTS] == "5"
    assert headers[Header.ERROR_QUEUE] == "billing"
    assert float(headers[Header.FAILED_AT]) > float(original.headers[Header.SENT_AT])

    [dead] = bus.dead_lettered
    assert dead.address == "errors"
    assert dead.message == Charge("o-1", 9.5)
    assert dead.message_id == message_id
    assert dead.error_type == qualified
    assert dead.error_message == "gateway refused o-1"
    assert dead.attempts == 5
    assert dead.source_queue == "billing"
    assert bus.dead_lettered_of(Charge) == [Charge("o-1", 9.5)]

    assert [r.headers[Header.ATTEMPT] for r in bus.retried] == ["3", "4"]
    assert [r.address for r in bus.retried] == ["billing", "billing"]
    assert all(r.message_id == message_id for r in bus.retried)

    # Every failed attempt was logged, with the message id: 4 retries and the dead-lettering.
    logged = warnings_about(caplog, message_id)
    assert len(logged) == 5
    assert logged[-1].levelno == logging.ERROR
    assert "errors" in logged[-1].getMessage()


@pytest.mark.parametrize(
    ("immediate", "retried"),
    [
        pytest.param(2, [], id="on an immediate retry"),
        pytest.param(1, ["2"], id="on its delayed retry"),
    ],
)
async def test_a_message_that_fails_twice_then_succeeds_is_not_dead_lettered(
    immediate: int, retried: list[str]
) -> None:
    attempts: list[int] = []
    done: list[Charge] = []

    async def handle(message: Charge, context: MessageContext) -> None:
        attempts.append(context.attempt)
        if context.attempt <= 2:
            raise PaymentGatewayDown("busy")
        done.append(message)

    policy = RetryPolicy(immediate=immediate, delayed=[0.05, 0.05], error_queue="errors")
    app = App("billing", retry=policy)
    app.route(Charge, "billing")
    app.register(Charge, handle)
    async with Harness(app) as bus:
        await app.send(Charge("o-1", 1.0))
        await bus.idle()
        assert len(bus.broker.queues["errors"]) == 0

    assert attempts == [1, 2, 3]
    assert done == [Charge("o-1", 1.0)]
    assert [r.headers[Header.ATTEMPT] for r in bus.retried] == retried
    assert bus.dead_lettered == []


async def test_fail_fast_exceptions_are_dead_lettered_after_one_call() -> None:
    calls: list[str] = []

    async def handle(message: Charge) -> None:
        calls.append(message.order_id)
        if message.order_id == "bad-card":
            raise InvalidCard("card number fails the Luhn check")
        raise PaymentGatewayDown("busy")

    policy = RetryPolicy(immediate=1, delayed=[0.05], error_queue="errors", fail_fast=(ValueError,))
    app = App("billing", retry=policy, concurrency=1)
    app.route(Charge, "billing")
    app.register(Charge, handle)
    async with Harness(app) as bus:
        await app.send(Charge("bad-card", 1.0))
        await bus.idle()
        assert calls == ["bad-card"]
        await app.send(Charge("other", 1.0))
        await bus.idle()

    # The ValueError subclass skipped every retry; the other failure used all three attempts.
    assert calls == ["bad-card", "other", "other", "other"]
    first, second = bus.dead_lettered
    assert first.message == Charge("bad-card", 1.0)
    assert first.attempts == 1
    assert first.error_type.endswith("InvalidCard")
    assert second.attempts == 3
    assert [r.message for r in bus.retried] == [Charge("other", 1.0)]


def raw(headers: dict[str, str], body: bytes) -> Envelope:
    return Envelope({Header.MESSAGE_ID: str(uuid.uuid4()), **headers}, body)


CHARGE = f"{Charge.__module__}.{Charge.__qualname__}"
JSON = {Header.CONTENT_TYPE: "application/json"}
GOOD_BODY = b'{"order_id": "o-1", "amount": 1.5}'


@pytest.mark.parametrize(
    ("headers", "body", "reason"),
    [
        pytest.param(
            {Header.TYPE: CHARGE, **JSON}, b'{"order_id": 5}', "does not match", id="body"
        ),
        pytest.param({Header.TYPE: CHARGE, **JSON}, b"{not json", "not valid JSON", id="json"),
        pytest.param({Header.TYPE: "x.Unknown", **JSON}, GOOD_BODY, "unknown", id="unknown-type"),
        pytest.param(JSON, GOOD_BODY, "no type header", id="no-type"),
        pytest.param(
            {Header.TYPE: CHARGE, **JSON},
            json.dumps({"order_id": "o" * 300, "amount": 1}).encode(),
            "cap",
            id="too-large",
        ),
        pytest.param(
            {Header.TYPE: CHARGE, Header.CONTENT_TYPE: "application/xml"},
            b"<charge/>",
            "content type",
            id="content-type",
        ),
    ],
)
async def test_an_undecodable_delivery_goes_straight_to_the_error_queue(
    caplog: pytest.LogCaptureFixture, headers: dict[str, str], body: bytes, reason: str
) -> None:
    handled: list[Charge] = []

    async def handle(message: Charge) -> None:
        handled.append(message)

    app = App(
        "billing",
        retry=RetryPolicy(immediate=2, delayed=[0.05], error_queue="errors"),
        max_body_size=256,
        concurrency=1,
    )
    app.route(Charge, "billing")
    app.register(Charge, handle)
    async with Harness(app) as bus:
        bad = raw(headers, body)
        await app.transport.send([Outgoing("billing", bad)])
        await app.send(Charge("good", 2.0))
        await bus.idle()
        errors = [stored.envelope for stored in bus.broker.queues["errors"].ready]

    assert handled == [Charge("good", 2.0)]
    [dead] = bus.dead_lettered
    assert dead.message_id == bad.message_id
    assert dead.attempts == 1
    assert dead.error_type == "mersal.errors.DecodeError"
    assert reason in dead.error_message
    assert dead.source_queue == "billing"
    assert bus.retried == []
    [envelope] = errors
    assert envelope.body == body
    for name, value in bad.headers.items():
        assert envelope.headers[name] == value
    assert warnings_about(caplog, bad.message_id or "")


async def test_the_worker_keeps_going_after_a_run_of_bad_deliveries() -> None:
    handled: list[int] = []

    async def handle(message: Ping) -> None:
        handled.append(message.n)

    app = App("pings", retry=RetryPolicy(immediate=0, delayed=[], error_queue="errors"))
    app.register(Ping, handle)
    ping = f"{Ping.__module__}.{Ping.__qualname__}"
    async with Harness(app) as bus:
        await app.transport.send(
            [
                Outgoing("pings", raw({Header.TYPE: ping, **JSON}, b"[]")),
                Outgoing("pings", raw({Header.TYPE: "nope", **JSON}, b"{}")),
                Outgoing("pings", raw({}, b'{"n": 1}')),
            ]
        )
        for n in range(5):
            await app.send_local(Ping(n))
        await bus.idle()

    assert sorted(handled) == [0, 1, 2, 3, 4]
    assert len(bus.dead_lettered) == 3
    assert len(bus.broker.queues["errors"]) == 3


async def test_a_failing_handler_logs_each_attempt_with_the_message_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handle(message: Ping) -> None:
        raise PaymentGatewayDown("nope")

    app = App("pings", retry=RetryPolicy(immediate=1, delayed=[0.05], error_queue="errors"))
    app.register(Ping, handle)
    async with Harness(app) as bus:
        message_id = await app.send_local(Ping(1))
        await bus.idle()

    logged = warnings_about(caplog, message_id)
    assert [r.levelno for r in logged] == [logging.WARNING, logging.WARNING, logging.ERROR]
    assert all("PaymentGatewayDown" in r.getMessage() for r in logged)
    assert "retrying now" in logged[0].getMessage()
    assert "retrying in 0.05s" in logged[1].getMessage()
    assert len(bus.dead_lettered) == 1


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", " application/json "]
)
async def test_json_with_parameters_or_another_case_is_json(content_type: str) -> None:
    handled: list[Charge] = []

    async def handle(message: Charge) -> None:
        handled.append(message)

    app = App("billing", retry=RetryPolicy(immediate=0, delayed=[], error_queue="errors"))
    app.register(Charge, handle)
    async with Harness(app) as bus:
        envelope = raw({Header.TYPE: CHARGE, Header.CONTENT_TYPE: content_type}, GOOD_BODY)
        await app.transport.send([Outgoing("billing", envelope)])
        await bus.idle()

    assert handled == [Charge("o-1", 1.5)]
    assert bus.dead_lettered == []


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Job:
    n: int


class Broken(Exception):
    """A failure raised on purpose."""


class Fatal(BaseException):
    """A BaseException that is not an Exception."""


class Unprintable(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


async def _cancelled() -> None:
    raise asyncio.CancelledError()


async def _fatal() -> None:
    raise Fatal("fatal on purpose")


async def _keyboard_interrupt() -> None:
    raise KeyboardInterrupt()


async def _system_exit() -> None:
    raise SystemExit(3)


async def _unprintable() -> None:
    raise Unprintable()


async def _hang() -> None:
    await asyncio.sleep(60)


THREE_ATTEMPTS = RetryPolicy(immediate=2, delayed=[], error_queue=ERROR_QUEUE)
"""Three attempts in a row, then the error queue."""


# The pipeline's steps end an attempt as the handler does.


async def test_a_first_step_that_always_raises_is_retried_then_dead_lettered() -> None:
    step_calls = 0
    handled: list[int] = []

    async def broken_step(context: MessageContext, next: Next[MessageContext]) -> None:
        nonlocal step_calls
        step_calls += 1
        raise Broken("the user's step is broken")

    async def handle(message: Job) -> None:
        handled.append(message.n)

    app = App("steps", retry=POLICY)
    app.register(Job, handle)
    app.incoming.insert_before("decode", "broken", broken_step)
    async with Harness(app) as bus:
        message_id = await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "steps")
        assert len(in_queue(bus.broker, "error")) == 1

    # Like a handler's failure: immediate retries, the delayed stage, then the error queue.
    assert step_calls == POLICY.max_attempts
    assert handled == []
    assert [r.message_id for r in bus.retried] == [message_id] * len(POLICY.delayed)
    [dead] = bus.dead_lettered
    assert dead.message_id == message_id
    assert dead.error_type == qualified(Broken)
    assert dead.error_message == "the user's step is broken"
    assert dead.attempts == POLICY.max_attempts
    assert dead.source_queue == "steps"


async def test_a_first_step_that_fails_once_is_retried_at_once_like_a_handler() -> None:
    step_calls = 0
    handled: list[int] = []

    async def flaky_step(context: MessageContext, next: Next[MessageContext]) -> None:
        nonlocal step_calls
        step_calls += 1
        if step_calls == 1:
            raise Broken("first time only")
        await next(context)

    async def handle(message: Job) -> None:
        handled.append(message.n)

    app = App("steps", retry=POLICY)
    app.register(Job, handle)
    app.incoming.insert_before("decode", "flaky", flaky_step)
    async with Harness(app) as bus:
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "steps")

    assert step_calls == 2
    assert handled == [1]
    assert bus.retried == []
    assert bus.dead_lettered == []


@pytest.mark.parametrize("anchor", ["decode", "dispatch"])
async def test_a_step_that_returns_without_next_or_outcome_dead_letters_with_a_reason(
    anchor: str,
) -> None:
    step_calls = 0
    handled: list[int] = []

    async def stops_short(context: MessageContext, next: Next[MessageContext]) -> None:
        nonlocal step_calls
        step_calls += 1

    async def handle(message: Job) -> None:
        handled.append(message.n)

    app = App("steps", retry=POLICY)
    app.register(Job, handle)
    app.incoming.insert_before(anchor, "stops_short", stops_short)
    async with Harness(app) as bus:
        message_id = await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "steps")
        assert len(in_queue(bus.broker, "error")) == 1

    assert step_calls == 1
    assert handled == []
    assert bus.retried == []
    [dead] = bus.dead_lettered
    assert dead.message_id == message_id
    assert "context.outcome" in dead.error_message
    assert dead.error_type


@pytest.mark.parametrize("anchor", ["decode", "dispatch"])
async def test_a_step_that_decides_ack_without_next_acks_without_handling(anchor: str) -> None:
    handled: list[int] = []

    async def skip(context: MessageContext, next: Next[MessageContext]) -> None:
        context.outcome = ACK

    async def handle(message: Job) -> None:
        handled.append(message.n)

    app = App("steps", retry=POLICY)
    app.register(Job, handle)
    app.incoming.insert_before(anchor, "skip", skip)
    async with Harness(app) as bus:
        await app.send_local(Job(1))
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "steps")

    assert handled == []
    assert bus.dead_lettered == []
    assert bus.retried == []


# Everything a handler can throw counts as an attempt.


@pytest.mark.parametrize(
    ("act", "error_type", "text"),
    [
        pytest.param(_cancelled, "asyncio.exceptions.CancelledError", "", id="CancelledError"),
        pytest.param(_fatal, qualified(Fatal), "fatal on purpose", id="BaseException"),
        pytest.param(_keyboard_interrupt, "builtins.KeyboardInterrupt", "", id="KeyboardInterrupt"),
        pytest.param(_system_exit, "builtins.SystemExit", "3", id="SystemExit"),
        pytest.param(
            _unprintable, qualified(Unprintable), "str() and repr() fail", id="unprintable"
        ),
        pytest.param(_hang, qualified(HandlerTimeout), "within 0.2s", id="hang"),
    ],
)
async def test_whatever_a_handler_raises_is_an_attempt_and_ends_in_the_error_queue_once(
    act: Callable[[], Awaitable[None]], error_type: str, text: str
) -> None:
    calls: list[int] = []
    pings: list[int] = []

    async def handle(message: Job, context: MessageContext) -> None:
        calls.append(context.attempt)
        await act()

    async def ping(message: Ping) -> None:
        pings.append(message.n)

    app = App("hostile", retry=POLICY, handler_timeout=0.2)
    app.register(Job, handle)
    app.register(Ping, ping)
    async with Harness(app) as bus:
        message_id = await app.send_local(Job(1))
        await eventually(lambda: len(calls) >= 1, "the first attempt of the job")
        await app.send_local(Ping(1))
        await eventually(lambda: pings == [1], "the worker handles a ping meanwhile")
        await bus.idle(timeout=5)
        await app.send_local(Ping(2))  # and after
        await bus.idle(timeout=5)
        assert_settled(bus.broker, "hostile")
        assert len(in_queue(bus.broker, "error")) == 1

    assert calls == [1, 2, 3]
    assert pings == [1, 2]
    [dead] = bus.dead_lettered
    assert dead.message_id == message_id
    assert dead.message == Job(1)
    assert set(ERROR_HEADERS) <= set(dead.headers)
    assert dead.error_type == error_type
    assert text in dead.error_message
    assert dead.attempts == POLICY.max_attempts
    assert dead.source_queue == "hostile"


async def test_a_handler_cancelling_its_own_task_fails_each_attempt_then_dead_letters(
    memory_url: str,
) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    app = App("self-cancel", transport=memory_url, retry=THREE_ATTEMPTS)
    app.register(Job, handle)
    app.route(Job, "self-cancel")
    async with app:
        broker = broker_of(app)
        await app.send(Job(1))
        [dead] = await dead_lettered(broker, "self-cancel")

    assert calls == THREE_ATTEMPTS.max_attempts
    assert dead.headers[Header.ERROR_TYPE].endswith("CancelledError")
    assert dead.headers[Header.ERROR_ATTEMPTS] == str(THREE_ATTEMPTS.max_attempts)


# What is and is not a duplicate; a stop is never a failure.


async def test_a_duplicate_a_handler_raises_fails_its_attempts(memory_url: str) -> None:
    """Only the inbox's `Duplicate` of the message being handled is acked unhandled."""
    app = App("dups", transport=memory_url, retry=RetryPolicy(immediate=1, delayed=()))
    calls: list[int] = []

    async def handle(message: Ping) -> None:
        calls.append(message.n)
        raise Duplicate("some-other-id")

    app.register(Ping, handle)
    app.route(Ping, "dups")
    async with Harness(app) as bus:
        await app.send(Ping(1))
        await bus.idle(10)

    assert calls == [1, 1]
    assert [d.error_type for d in bus.dead_lettered] == ["mersal.errors.Duplicate"]


async def test_a_stop_the_handler_turns_into_another_error_gives_the_message_back(
    memory_url: str,
) -> None:
    app = App(
        "stopped",
        transport=memory_url,
        retry=RetryPolicy(immediate=0, delayed=()),
        grace_period=0.1,
    )
    started = asyncio.Event()

    async def handle(message: Ping) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("the cleanup after the cancellation failed") from None

    app.register(Ping, handle)
    app.route(Ping, "stopped")
    await app.start()
    await app.send(Ping(1))
    await asyncio.wait_for(started.wait(), 10)
    await app.stop()

    broker = MemoryTransport(memory_url).broker
    assert len(broker.queues["stopped"]) == 1
    error_queue = broker.queues.get("error")
    assert error_queue is None or len(error_queue) == 0
