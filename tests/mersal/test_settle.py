"""How a delivery ends (mersal/settle.py), on the memory transport: one Settler acks, retries,
dead-letters or gives back each delivery once.

Every delivery is acked or nacked exactly once whatever its handler does; a dead letter that
cannot leave (the error queue refuses it) returns its delivery once and leaves later, and its
message is not handled again; a hostile message still reaches the error queue with headers the
broker carries; the outcomes remembered for replays are bounded by bytes; each reply is settled
once.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mersal.transport.limits
from mersal import (
    App,
    Delivery,
    Envelope,
    Header,
    MessageContext,
    RetryPolicy,
)
from mersal.dead_letters import DeadLetters
from mersal.pipeline import Next
from mersal.settle import Failure, Outcome, Settler, Verdict, remembered_size
from mersal.testing import Harness
from mersal.transaction import TransactionClosed
from mersal.transport import Consumer, Outgoing
from mersal.transport.memory import MemoryTransport
from tests.mersal.support import (
    ERROR_QUEUE,
    CountingTransport,
    RefusingErrorQueue,
    assert_settled,
    broker_of,
    dead_lettered,
    in_queue,
    number_of,
    qualified,
    quiet,
)
from tests.support import DelegatingTransport, eventually

pytestmark = pytest.mark.timeout(60)

POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Job:
    n: int


class Broken(Exception):
    """A failure raised on purpose."""


class Fatal(BaseException):
    """A BaseException that is not an Exception."""


def raw(app: App, body: object, headers: Mapping[str, str] | None = None) -> Envelope:
    """An envelope for `body` as a producer other than Mersal would put it on the broker."""
    base = {
        Header.MESSAGE_ID: str(uuid.uuid4()),
        Header.TYPE: app.types.name_of(type(body)),
        Header.CONTENT_TYPE: app.codec.content_type,
    }
    return Envelope({**base, **(headers or {})}, app.codec.encode(body))


# Each delivery settled once, and a dead letter that cannot leave.


async def _raise_broken(message: Job) -> None:
    raise Broken("handler failed")


async def _raise_fatal(message: Job) -> None:
    raise Fatal("handler failed hard")


async def _succeed(message: Job) -> None:
    return None


@pytest.mark.parametrize(
    ("handler", "step", "inject_unknown", "deliveries", "dead"),
    [
        pytest.param(_succeed, None, False, 1, 0, id="handled"),
        pytest.param(_raise_broken, None, False, 2, 1, id="handler raises"),
        pytest.param(_raise_fatal, None, False, 2, 1, id="handler raises BaseException"),
        pytest.param(_succeed, "raises", False, 2, 1, id="first step raises"),
        pytest.param(_succeed, "stops", False, 1, 1, id="step stops short"),
        pytest.param(_succeed, None, True, 1, 1, id="unknown type"),
    ],
)
async def test_every_delivery_is_acked_or_nacked_exactly_once(
    memory_url: str,
    handler: Callable[[Job], Awaitable[None]],
    step: str | None,
    inject_unknown: bool,
    deliveries: int,
    dead: int,
) -> None:
    async def user_step(context: MessageContext, next: Next[MessageContext]) -> None:
        if step == "raises":
            raise Broken("step failed")
        if step != "stops":
            await next(context)

    transport = CountingTransport(memory_url)
    app = App("counted", transport=transport, retry=POLICY)
    app.register(Job, handler)
    app.incoming.insert_before("decode", "user", user_step)
    async with app:
        broker = transport.broker
        if inject_unknown:
            envelope = raw(app, Job(1), {Header.TYPE: "nobody.Knows.v1"})
            broker.route(Outgoing("counted", envelope))
        else:
            await app.send_local(Job(1))
        await eventually(
            lambda: len(broker.queues["error"]) == dead,
            "every dead letter in the error queue",
            timeout=5,
        )
        await quiet(broker, app)
        assert_settled(broker, "counted")
        settles = transport.settles("counted")
    assert settles == [["ack"]] * deliveries


async def test_a_dead_letter_that_cannot_leave_returns_the_delivery_once_then_leaves(
    memory_url: str,
) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        raise Broken("always")

    transport = CountingTransport(memory_url, refuse_to="error")
    app = App("counted", transport=transport, retry=RetryPolicy(immediate=0, delayed=[]))
    app.register(Job, handle)
    async with app:
        broker = transport.broker
        await app.send_local(Job(1))
        await eventually(
            lambda: len(broker.queues["error"]) == 1,
            "the dead letter in the error queue",
            timeout=5,
        )
        await quiet(broker, app)
        assert_settled(broker, "counted")
        settles = transport.settles("counted")
    assert transport.refused == 1
    assert settles == [["nack"], ["ack"]]
    assert calls == 1  # its outcome was remembered: the returned delivery is not handled again


class AlwaysRefused(DelegatingTransport):
    """A transport whose broker is away for every send."""

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Refuse every message."""
        return [ConnectionError("the broker is away (on purpose)") for _ in messages]


class TakesWhenLet(CountingTransport):
    """A counting memory transport whose consumers take `allowed` deliveries, then wait."""

    def __init__(self, url: str, *, refuse_to: str | None = None, allowed: int = 1) -> None:
        super().__init__(url, refuse_to=refuse_to)
        self.allowed = allowed
        self.taken = 0
        self.let = asyncio.Event()

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume, counting; past `allowed` deliveries, only once `let` is set."""
        counting = await super().consume(queue, prefetch=prefetch)
        transport = self

        class Gated:
            async def get(self) -> Delivery:
                if transport.taken >= transport.allowed:
                    await transport.let.wait()
                transport.taken += 1
                return await counting.get()

            async def close(self) -> None:
                await counting.close()

        return Gated()


async def test_a_replay_of_a_message_whose_dead_letter_could_not_leave_is_handled(
    memory_url: str,
) -> None:
    broken = True
    handled: list[int] = []

    async def handle(message: Job) -> None:
        if broken:
            raise Broken("until fixed")
        handled.append(message.n)

    policy = RetryPolicy(immediate=0, delayed=[])
    first = TakesWhenLet(memory_url, refuse_to="error")  # its dead letter cannot leave
    second = TakesWhenLet(memory_url)
    one, other = (
        App("counted", transport=first, retry=policy),
        App("counted", transport=second, retry=policy),
    )
    for app in (one, other):
        app.register(Job, handle)
    async with one:
        one.settler.backoff = 0.01
        await one.send_local(Job(1))
        await eventually(lambda: first.refused == 1 and first.taken == 1, "the dead letter refused")
        async with other:  # the returned delivery goes to another instance, which dead-letters it
            await eventually(lambda: len(first.broker.queues["error"]) == 1, "the dead letter")
            await quiet(first.broker, other)
        broken = False
        replays = await DeadLetters(first.inner, "error").replay()
        assert [replay.done for replay in replays] == [True]
        first.let.set()  # the instance that remembers the failed attempt takes the replay
        await eventually(lambda: handled == [1], "the replay handled")
        await quiet(first.broker, one)
    assert len(first.broker.queues["error"]) == 0


async def test_the_remembered_outcomes_are_bounded_by_bytes(memory_url: str) -> None:
    transport = MemoryTransport(memory_url)
    settler = Settler(AlwaysRefused(transport), "error", backoff=0, remember_bytes=100_000)
    failure = Failure("tests.Broken", "m" * 1_000, "t" * 16_384)
    kept = 100_000 // remembered_size(("m-10", "", "", ""), Outcome.dead_letter(failure, 1))
    await transport.start()
    transport.broker.declare("work")
    for n in range(50):
        await transport.send([Outgoing("work", Envelope({Header.MESSAGE_ID: f"m-{n}"}, b"{}"))])
    consumer = await transport.consume("work", prefetch=100)
    deliveries = [await consumer.get() for _ in range(50)]
    for delivery in deliveries:  # every dead letter stays behind
        assert await settler.settle(delivery, Outcome.dead_letter(failure, 1)) is Verdict.GIVE_BACK
    assert 0 < settler.remembered_bytes <= 100_000 and kept == 5
    redelivered = [await consumer.get() for _ in range(50)]
    remembered = [settler.unsent(delivery) is not None for delivery in redelivered]
    assert remembered == [False] * (50 - kept) + [True] * kept  # the oldest forgotten first
    assert settler.remembered_bytes == 0
    await transport.stop()


# A dead letter always leaves, whatever headers its message came with.


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({str(i): "" for i in range(20_000)}, id="20000-tiny-headers"),
        pytest.param({"huge": "x" * 300_000}, id="one-huge-value"),
        pytest.param({"bad": "\ud800", "\udc80": "v"}, id="lone-surrogates"),
        pytest.param({"CC": "x", "y" * 200: "z"}, id="reserved-and-long-names"),
    ],
)
async def test_a_hostile_message_that_always_fails_reaches_the_error_queue_once(
    headers: dict[str, str],
) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        raise Broken("always fails")

    app = App("hostile", retry=POLICY)
    app.register(Job, handle)
    async with Harness(app) as bus:
        envelope = raw(app, Job(1), headers)
        message_id = envelope.headers[Header.MESSAGE_ID]
        bus.broker.route(Outgoing("hostile", envelope))  # no check: a hostile producer
        await bus.idle(timeout=10)
        assert_settled(bus.broker, "hostile")
        [dead] = in_queue(bus.broker, "error")

    assert calls == POLICY.max_attempts
    assert len(bus.dead_lettered) == 1
    assert mersal.transport.limits.problem_of(Outgoing("error", dead)) is None
    assert dead.headers[Header.ERROR_TYPE] == qualified(Broken)
    assert dead.headers[Header.ERROR_MESSAGE] == "always fails"
    assert dead.headers[Header.ERROR_ATTEMPTS] == str(POLICY.max_attempts)
    assert dead.headers[Header.ERROR_QUEUE] == "hostile"
    assert Header.FAILED_AT in dead.headers
    assert dead.headers[Header.MESSAGE_ID] == message_id
    assert dead.body == envelope.body


THREE_ATTEMPTS = RetryPolicy(immediate=2, delayed=[], error_queue=ERROR_QUEUE)
"""Three attempts in a row, then the error queue."""


# A dead letter the error queue refuses for a while.


async def test_a_message_whose_dead_letter_is_refused_is_not_handled_again(memory_url: str) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        raise Broken("always fails")

    transport = RefusingErrorQueue(memory_url, refusals=3)
    app = App("full-errors", transport=transport, retry=THREE_ATTEMPTS)
    app.register(Job, handle)
    app.route(Job, "full-errors")
    async with app:
        app.settler.backoff = 0.01  # return the delivery at once after a refusal
        broker = broker_of(app)
        await app.send(Job(1))
        [dead] = await dead_lettered(broker, "full-errors")

    assert transport.refused == 3  # refused three times, taken the fourth
    assert calls == THREE_ATTEMPTS.max_attempts  # not handled again each time it came back
    assert dead.headers[Header.ERROR_ATTEMPTS] == str(THREE_ATTEMPTS.max_attempts)
    assert number_of(dead) == 1


EXPLORE = os.environ.get("MERSAL_FUZZ") == "explore"
"""`make fuzz`: new random examples, ten times as many; `make test`: the same ones every run."""


HOSTILE = settings(
    max_examples=250 if EXPLORE else 25,
    derandomize=not EXPLORE,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


FAST_POLICY = RetryPolicy(immediate=1, delayed=[0.01], error_queue="error")


HANDLER_TIMEOUT = 0.1


CAP = 64 * 1024
"""The app's max_body_size: a body over it is dead-lettered before any handler runs."""


PRODUCED = 4 * CAP
"""The size of the large message a "huge" handler sends."""


FAILS = ("raise", "base", "keyboard", "system_exit", "cancel", "unprintable", "hang")
"""The behaviours that fail every attempt."""


@dataclass(frozen=True)
class Behaviour:
    """What the handler does with one message."""

    kind: str
    k: int = 0
    """For "succeed_on": the attempt that succeeds."""
    size: int = 0
    """For "huge": the size of the incoming message's payload."""

    def expected(self) -> tuple[str, int]:
        """("handled" or "dead", handler calls) this message must end with."""
        attempts = FAST_POLICY.max_attempts
        if self.kind in FAILS:
            return "dead", attempts
        if self.kind == "succeed_on":
            return ("handled", self.k) if self.k <= attempts else ("dead", attempts)
        if self.kind == "huge" and self.size > CAP:
            return "dead", 0
        return "handled", 1


@dataclass
class Hostile:
    n: int
    payload: str = ""


@dataclass
class Produced:
    n: int
    payload: str


@dataclass
class Late:
    n: int


@dataclass
class Plain:
    n: int


class Unprintable(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@dataclass
class Record:
    """What the handlers of one example did."""

    behaviours: list[Behaviour]
    calls: Counter[int] = field(default_factory=Counter)
    successes: Counter[int] = field(default_factory=Counter)
    plain: list[int] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    late: list[asyncio.Task[str]] = field(default_factory=list)


async def act(record: Record, message: Hostile, context: MessageContext) -> None:
    """Do what the message's behaviour says."""
    behaviour = record.behaviours[message.n]
    kind = behaviour.kind
    app = context.app
    if kind == "raise":
        raise RuntimeError(f"message {message.n} fails")
    if kind == "base":
        raise Fatal(f"message {message.n} fails hard")
    if kind == "keyboard":
        raise KeyboardInterrupt()
    if kind == "system_exit":
        raise SystemExit(message.n)
    if kind == "cancel":
        raise asyncio.CancelledError()
    if kind == "unprintable":
        raise Unprintable()
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "succeed_on" and context.attempt < behaviour.k:
        raise RuntimeError(f"message {message.n} fails on attempt {context.attempt}")
    if kind == "late_send":
        record.late.append(asyncio.create_task(send_late(record, app, message.n)))
    if kind == "huge":
        await app.send(Produced(message.n, "y" * PRODUCED))


async def send_late(record: Record, app: App, n: int) -> str:
    """Send once the test says so: after the handler that started this task returned."""
    await record.release.wait()
    return await app.send(Late(n))


async def run(behaviours: list[Behaviour]) -> None:
    """Run one batch through a fresh app and check what became of every message."""
    record = Record(behaviours)

    async def handle(message: Hostile, context: MessageContext) -> None:
        record.calls[message.n] += 1
        await act(record, message, context)
        record.successes[message.n] += 1

    async def plain(message: Plain) -> None:
        record.plain.append(message.n)

    app = App(
        "hostile",
        retry=FAST_POLICY,
        handler_timeout=HANDLER_TIMEOUT,
        max_body_size=CAP,
        concurrency=8,
    )
    app.register(Hostile, handle)
    app.register(Plain, plain)
    app.route(Produced, "sink")
    app.route(Late, "sink")
    async with Harness(app) as bus:
        broker = bus.broker
        sink = broker.declare("sink")
        for n, behaviour in enumerate(behaviours):
            await app.send_local(Hostile(n, "x" * behaviour.size))
            await app.send_local(Plain(n))  # the worker keeps handling others throughout
        await bus.idle(timeout=20)

        record.release.set()
        async with asyncio.timeout(5):
            late = await asyncio.gather(*record.late, return_exceptions=True)
        await app.send_local(Plain(-1))
        await bus.idle(timeout=20)

        hostile = broker.queues["hostile"]
        assert hostile.unacked == 0
        assert not hostile.ready
        dead = Counter(
            json.loads(stored.envelope.body)["n"] for stored in broker.queues["error"].ready
        )
        reasons = [stored.envelope.headers for stored in broker.queues["error"].ready]
        arrived = [json.loads(stored.envelope.body) for stored in sink.ready]

    assert all(reason.get(Header.ERROR_TYPE) for reason in reasons)
    for n, behaviour in enumerate(behaviours):
        outcome, calls = behaviour.expected()
        ended = (record.successes[n], dead[n])
        assert ended in ((1, 0), (0, 1)), f"message {n} ({behaviour}) ended {ended}"
        assert record.calls[n] <= FAST_POLICY.max_attempts, f"message {n} ({behaviour})"
        assert ended == ((1, 0) if outcome == "handled" else (0, 1)), f"{n}: {behaviour}"
        assert record.calls[n] == calls, f"message {n} ({behaviour})"
    assert sorted(record.plain) == [-1, *range(len(behaviours))]
    assert all(isinstance(result, TransactionClosed) for result in late), late
    assert len(late) == sum(b.kind == "late_send" for b in behaviours)
    assert [body["n"] for body in arrived if "payload" not in body] == []  # no Late arrived
    produced = sorted(body["n"] for body in arrived)
    assert produced == [n for n, b in enumerate(behaviours) if b.kind == "huge" and b.size <= CAP]
    assert all(len(body["payload"]) == PRODUCED for body in arrived)


KINDS = ["succeed", "late_send", "succeed_on", "huge", *FAILS]


def behaviour(kind: str, k: int, size: int) -> Behaviour:
    """A behaviour of `kind`, with the attempt or size only where the kind uses it."""
    return Behaviour(kind, k if kind == "succeed_on" else 0, size if kind == "huge" else 0)


BEHAVIOURS = st.builds(
    behaviour,
    st.sampled_from(KINDS),
    st.integers(1, FAST_POLICY.max_attempts + 1),
    st.sampled_from([CAP // 2, 2 * CAP]),
)


# Hostile handlers (Hypothesis): a batch of messages, each with what its handler does (succeed;
# raise an Exception, a BaseException, KeyboardInterrupt, SystemExit or CancelledError; raise an
# exception that cannot be printed; hang past the timeout; send from a task after returning;
# succeed only on attempt k; a large body). Every message ends once and the worker goes on.
# `make fuzz` explores more examples (MERSAL_FUZZ=explore).


@HOSTILE
@given(st.lists(BEHAVIOURS, min_size=1, max_size=12))
def test_every_message_ends_once_whatever_its_handler_does(behaviours: list[Behaviour]) -> None:
    asyncio.run(run(behaviours))
