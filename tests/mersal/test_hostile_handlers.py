"""Hostile handlers: whatever handlers do, every message ends once and the worker goes on.

Hypothesis draws a batch of messages, each with what its handler does: succeed; raise an
Exception, a BaseException subclass, KeyboardInterrupt, SystemExit or CancelledError; raise an
exception whose `__str__` and `__repr__` raise; hang past the handler timeout; start a task that
sends after the handler returned; succeed only on attempt k; arrive or send with a large body.
Each example runs one app on a private memory broker (mersal.testing.Harness) in a fresh loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mersal import App, Header, MessageContext, RetryPolicy
from mersal.testing import Harness
from mersal.transaction import TransactionClosed

EXPLORE = os.environ.get("MERSAL_FUZZ") == "explore"
"""`make fuzz`: new random examples, ten times as many; `make test`: the same ones every run."""

HOSTILE = settings(
    max_examples=250 if EXPLORE else 25,
    derandomize=not EXPLORE,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

POLICY = RetryPolicy(immediate=1, delayed=[0.01], error_queue="error")
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
        attempts = POLICY.max_attempts
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


class Fatal(BaseException):
    """A BaseException that is not an Exception."""


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
        retry=POLICY,
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
        assert record.calls[n] <= POLICY.max_attempts, f"message {n} ({behaviour})"
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
    st.integers(1, POLICY.max_attempts + 1),
    st.sampled_from([CAP // 2, 2 * CAP]),
)


@HOSTILE
@given(st.lists(BEHAVIOURS, min_size=1, max_size=12))
def test_every_message_ends_once_whatever_its_handler_does(behaviours: list[Behaviour]) -> None:
    asyncio.run(run(behaviours))
