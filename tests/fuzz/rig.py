"""One App on a private memory broker, fed raw envelopes from synchronous (Hypothesis) tests.

A Hypothesis test runs many examples against one app: the rig owns an event loop, starts the app
once, and for each batch of raw deliveries reports what became of each one (handled, or in the
error queue with which headers) by a probe header of its own, then checks the invariants.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings

from mersal import App, Envelope, Header, MessageContext, Outgoing, RetryPolicy, message, settle
from mersal.transport.limits import CUT_TO
from mersal.transport.memory import MemoryBroker, MemoryTransport
from tests.fuzz.corpus import (
    PICKLE_BOMB,
    canaries_imported,
    nested,
    order_json,
    surely_not_an_order,
)
from tests.support import eventually

ORDER = "fuzz.Order.v1"
DOOMED = "fuzz.Doomed.v1"
JSON = "application/json"
CAP = 8_192
PROBE = "x-fuzz-probe"
DECODE_ERROR = "mersal.errors.DecodeError"
ERROR_HEADERS = frozenset(settle.ERROR_HEADERS)

HANDLED = "handled"
"""The delivery must be handled exactly once and not dead-lettered."""
EITHER = "either"
"""A body no oracle can judge: handled once, or dead-lettered once for its body."""

EXPLORE = os.environ.get("MERSAL_FUZZ") == "explore"
"""`make fuzz`: new random examples, ten times as many; `make test`: the same ones every run."""

FUZZ = settings(
    max_examples=600 if EXPLORE else 60,
    derandomize=not EXPLORE,  # a fresh clone runs exactly what every other machine ran
    deadline=None,
    database=None,  # nothing left in the working tree; a failure prints its example
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one app serves every example, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,  # a body over the cap is large by definition
    ],
)


@message(ORDER)
@dataclass
class Order:
    order_id: str
    amount: float


@message(DOOMED)
@dataclass
class Doomed:
    order_id: str


class Doom(Exception):
    """What the handler of Doomed always raises."""


@dataclass(frozen=True)
class Case:
    """One raw delivery and what must become of it."""

    headers: dict[str, str]
    body: bytes
    expect: str  # HANDLED, EITHER, or a fragment of the error message it must get


def verdict(headers: dict[str, str], body: bytes, body_ok: bool | None, cap: int = CAP) -> str:
    """What must become of a delivery, judged in the order the decode step checks."""
    if len(body) > cap:
        return f"over the {cap}-byte cap"
    name = headers.get(Header.TYPE)
    if not name:
        return "no type header"
    content_type = headers.get(Header.CONTENT_TYPE)
    if content_type and content_type != JSON:
        return "content type"
    if name != ORDER:
        return "unknown message type"
    if body_ok:
        return HANDLED
    if body_ok is False or surely_not_an_order(body):
        return "body"
    return EITHER


def case(headers: dict[str, str], body: bytes, body_ok: bool | None = None) -> Case:
    """A delivery whose expected fate follows from its headers and body."""
    return Case(headers, body, verdict(headers, body, body_ok))


def order_headers(**extra: str) -> dict[str, str]:
    """The headers of a well-formed Order from a foreign producer."""
    return {Header.TYPE: ORDER, Header.CONTENT_TYPE: JSON, **extra}


@dataclass
class Report:
    """What became of one batch."""

    probes: list[str]
    handled: Counter[str]
    failed: Counter[str]
    dead: dict[str, list[Envelope]]
    strays: list[Envelope]
    sentinel: int
    imported: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Unsettled:
    """What keeps a batch from being settled: false, so that `eventually` keeps waiting."""

    unaccounted_for: int
    ready: int
    unacked: int
    delayed: int
    in_flight: int

    def __bool__(self) -> bool:
        return False


class Rig:
    """An app with a counting Order handler and an always-failing Doomed handler."""

    def __init__(self, *, retry: RetryPolicy | None = None, cap: int = CAP) -> None:
        self.loop = asyncio.new_event_loop()
        self.cap = cap
        self.error_queue = "fuzz.error"
        self.app = App(
            "fuzz",
            transport=f"memory://fuzz-{uuid.uuid4().hex}",
            retry=retry or RetryPolicy(immediate=1, delayed=[60.0], error_queue=self.error_queue),
            max_body_size=cap,
            concurrency=8,
        )
        assert self.app.retry.error_queue == self.error_queue
        self.handled: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        handled, failed = self.handled, self.failed

        async def take_order(message: Order, context: MessageContext) -> None:
            handled[context.headers.get(PROBE, "")] += 1

        async def doom(message: Doomed, context: MessageContext) -> None:
            failed[context.headers.get(PROBE, "")] += 1
            raise Doom(f"{message.order_id} is doomed")

        self.app.register(Order, take_order)
        self.app.register(Doomed, doom)

    @property
    def broker(self) -> MemoryBroker:
        """The app's private memory broker."""
        transport = self.app.transport
        assert isinstance(transport, MemoryTransport)
        return transport.broker

    def start(self) -> None:
        """Start the app and warm it up, so that first-use imports happen before any check."""
        self.loop.run_until_complete(self.app.start())
        warm_up = [
            case(order_headers(), order_json(), body_ok=True),
            case(order_headers(), b"\xff not json"),
            case(order_headers(), b'{"order_id": "o-1", "amount": "9.5"}'),
            case(order_headers(), order_json(x=[[[]]]).replace(b"[[[]]]", nested(3_000).encode())),
            case(order_headers(**{Header.TYPE: "os.system"}), order_json()),
            case(
                order_headers(**{Header.CONTENT_TYPE: "application/x-python-pickle"}), PICKLE_BOMB
            ),
            case({}, order_json()),
            case(order_headers(), b" " * (self.cap + 1)),
        ]
        self.check(warm_up)

    def stop(self) -> None:
        """Stop the app and close the loop."""
        try:
            self.loop.run_until_complete(self.app.stop())
        finally:
            self.loop.close()

    def run(self, cases: Sequence[Case], *, timeout: float = 3.0) -> Report:
        """Send the batch and a good message after it; report once everything settled."""
        before = set(sys.modules)
        report = self.loop.run_until_complete(self._run(cases, timeout))
        report.imported = sorted(
            name
            for name in set(sys.modules) - before
            if not name.startswith(("hypothesis", "_hypothesis"))
        )
        return report

    def check(self, cases: Sequence[Case]) -> Report:
        """Run the batch and assert every invariant of the decode path."""
        report = self.run(cases)
        assert not report.imported, f"handling the batch imported {report.imported}"
        assert not canaries_imported(), f"a type name imported {canaries_imported()}"
        assert report.sentinel == 1, "the good message sent after the batch was not handled once"
        assert not report.strays, (
            f"{len(report.strays)} unexpected message(s) in the error queue "
            f"(left by an earlier failure?), e.g. {report.strays[0]!r:.400}"
        )
        for one, probe in zip(cases, report.probes, strict=True):
            self._check_case(one, report.handled[probe], report.dead.get(probe, []))
        return report

    def _check_case(self, one: Case, handled: int, dead: list[Envelope]) -> None:
        what = f"{one!r:.600}"
        if one.expect == HANDLED or (one.expect == EITHER and handled):
            assert (handled, len(dead)) == (1, 0), f"handled {handled}x, dead {len(dead)}x: {what}"
            return
        assert handled == 0, f"a handler ran for a bad delivery: {what}"
        assert len(dead) == 1, f"in the error queue {len(dead)} times, not once: {what}"
        [envelope] = dead
        headers = envelope.headers
        reason = "body" if one.expect == EITHER else one.expect
        assert headers[Header.ERROR_TYPE] == DECODE_ERROR, f"{headers[Header.ERROR_TYPE]}: {what}"
        assert reason in headers[Header.ERROR_MESSAGE], f"{headers[Header.ERROR_MESSAGE]!r:.300}"
        assert headers[Header.ERROR_QUEUE] == self.app.name
        assert envelope.body == one.body, f"the body changed on the way to the error queue: {what}"
        kept = {
            name: value
            for name, value in one.headers.items()
            if name not in ERROR_HEADERS and name != Header.DELIVER_AT
        }
        for name, value in kept.items():  # kept, or (too long for a dead letter) cut and marked
            arrived = headers.get(name)
            value = value.encode("utf-8", "replace").decode("utf-8")  # text a broker can carry
            if arrived != value:
                assert arrived is not None, f"header {name!r} lost: {what}"
                assert arrived.startswith(value[:CUT_TO]), f"header {name!r} changed: {what}"
                assert arrived.endswith("characters cut]"), f"header {name!r} changed: {what}"

    async def _run(self, cases: Sequence[Case], timeout: float) -> Report:
        probes = [uuid.uuid4().hex for _ in cases]
        sentinel = uuid.uuid4().hex
        batch = [
            Outgoing(self.app.name, Envelope({**one.headers, PROBE: probe}, one.body))
            for one, probe in zip(cases, probes, strict=True)
        ]
        batch.append(
            Outgoing(self.app.name, Envelope(order_headers(**{PROBE: sentinel}), order_json()))
        )
        for outgoing in batch:  # as a hostile producer would: past the transport's own checks
            self.broker.route(outgoing)
        await self._settle([*probes, sentinel], timeout)
        # A duplicate still coming would show up while the worker takes one more message.
        after = uuid.uuid4().hex
        self.broker.route(
            Outgoing(self.app.name, Envelope(order_headers(**{PROBE: after}), order_json()))
        )
        await self._settle([after], timeout)
        self.handled.pop(after, 0)
        dead: dict[str, list[Envelope]] = {}
        strays: list[Envelope] = []
        wanted = set(probes)
        errors = self.broker.queues[self.error_queue]
        for stored in errors.ready:
            probe = stored.envelope.headers.get(PROBE, "")
            if probe in wanted:
                dead.setdefault(probe, []).append(stored.envelope)
            else:
                strays.append(stored.envelope)
        errors.ready.clear()
        return Report(
            probes,
            Counter({p: self.handled.pop(p) for p in probes if p in self.handled}),
            Counter({p: self.failed.pop(p) for p in probes if p in self.failed}),
            dead,
            strays,
            self.handled.pop(sentinel, 0),
        )

    async def _settle(self, probes: list[str], timeout: float) -> None:
        """Wait until every probe was handled or dead-lettered and the input queue is idle."""
        await eventually(
            lambda: self._settled(probes),
            "every delivery handled or dead-lettered and the input queue idle "
            "(a bad delivery in a delayed retry instead of the error queue?)",
            timeout=timeout,
            interval=0.001,
        )

    def _settled(self, probes: list[str]) -> bool | Unsettled:
        """True once settled; else what is left."""
        broker = self.broker
        queue = broker.queues[self.app.name]
        in_error_queue = {
            s.envelope.headers.get(PROBE) for s in broker.queues[self.error_queue].ready
        }
        missing = sum(
            1
            for p in probes
            if not self.handled[p] and p not in in_error_queue and not self.failed[p]
        )
        left = Unsettled(
            missing, len(queue.ready), queue.unacked, broker.delayed, self.app.in_flight
        )
        return left == Unsettled(0, 0, 0, 0, 0) or left
