"""What the property tests found on a fresh machine, as explicit examples.

- A header holding a lone surrogate ('\\ud800'), which the memory transport can carry and a
  lenient decoder can produce: the delivery reaches the error queue once, with its headers
  mended (the surrogate replaced), instead of coming back every second because fitting the
  dead letter's headers raised `UnicodeEncodeError`. In the type header and in another header,
  for a message refused at decode and for one whose handler fails (a delayed retry copy first).
- A body nested deeper than the decoder's recursion limit is refused for its nesting at once;
  and the RecursionError it raises in this process does not stop the source checks of
  `tests/test_no_unsafe_code.py`, which parse in a fresh interpreter (CPython 3.11
  can be left unable to parse after a RecursionError: `AST constructor recursion depth
  mismatch`).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from mersal import App, Envelope, Header, MessageContext, Outgoing, RetryPolicy, message
from mersal.transport.memory import MemoryBroker, MemoryTransport
from tests.fuzz.corpus import nested
from tests.support import eventually

ROOT = Path(__file__).resolve().parents[2]
ORDER = "regressions.Order.v1"
JSON = "application/json"
DECODE_ERROR = "mersal.errors.DecodeError"
SURROGATE = "\ud800"
DEPTH = 100_000


@message(ORDER)
@dataclass
class Order:
    """A well-formed order; `doomed` ones make the handler fail."""

    order_id: str
    amount: float


class Doom(Exception):
    """The handler's failure for a doomed order."""


@dataclass
class Rig:
    """A running app on a private memory broker and what its handler saw."""

    app: App
    broker: MemoryBroker
    calls: Counter[str]

    def route(self, headers: dict[str, str], body: bytes) -> None:
        """Put a raw delivery on the app's queue, as a hostile producer would."""
        self.broker.route(Outgoing(self.app.name, Envelope(headers, body)))

    async def settled(self, dead: int) -> list[Envelope]:
        """Wait until `dead` dead letters arrived and nothing is left to handle; return them."""
        errors = self.broker.queues[self.app.retry.error_queue]
        home = self.broker.queues[self.app.name]
        await eventually(
            lambda: (
                len(errors) >= dead
                and home.idle
                and not self.broker.delayed
                and self.app.in_flight == 0
            ),
            f"{dead} dead letter(s) and an idle queue",
            timeout=5,
        )
        return [stored.envelope for stored in errors.ready]


@asynccontextmanager
async def running(retry: RetryPolicy) -> AsyncIterator[Rig]:
    """An app with an Order handler (counting calls by message id) on its own memory broker."""
    tag = uuid.uuid4().hex[:8]
    app = App(f"regressions-{tag}", transport=f"memory://regressions-{tag}", retry=retry)
    calls: Counter[str] = Counter()

    async def take(order: Order, context: MessageContext) -> None:
        calls[context.message_id] += 1
        if order.order_id == "doomed":
            raise Doom(f"order {order.order_id} fails on purpose")

    app.register(Order, take)
    async with app:
        transport = app.transport
        assert isinstance(transport, MemoryTransport)
        yield Rig(app, transport.broker, calls)


def mended(text: str) -> str:
    """The text as a transport carries it: lone surrogates replaced."""
    return text.encode("utf-8", "replace").decode("utf-8")


def order_body(order_id: str) -> bytes:
    """An Order's JSON body."""
    return msgspec.json.encode({"order_id": order_id, "amount": 9.5})


CASES = {
    # what the header holds: (headers beyond the id, order id, failure expected, attempts)
    "type header alone": ({Header.TYPE: SURROGATE}, "o-1", "unknown message type", 1),
    "type header": ({Header.TYPE: f"regressions.{SURROGATE}.v1"}, "o-1", "unknown", 1),
    "another header's value": (
        {Header.TYPE: ORDER, "x-note": f"bad {SURROGATE} value"},
        "doomed",
        "fails on purpose",
        3,
    ),
    "another header's name": (
        {Header.TYPE: ORDER, f"x-{SURROGATE}-note": "fine"},
        "doomed",
        "fails on purpose",
        3,
    ),
    "the reply-to and the partition key": (
        {Header.TYPE: ORDER, Header.REPLY_TO: SURROGATE, Header.PARTITION_KEY: SURROGATE},
        "doomed",
        "fails on purpose",
        3,
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", sorted(CASES))
async def test_a_lone_surrogate_in_a_header_reaches_the_error_queue_once_mended(
    where: str,
) -> None:
    extra, order_id, reason, attempts = CASES[where]
    message_id = f"surrogate-{uuid.uuid4().hex}"
    headers = {Header.MESSAGE_ID: message_id, Header.CONTENT_TYPE: JSON, **extra}
    body = order_body(order_id)
    retry = RetryPolicy(immediate=1, delayed=[0.05], error_queue="regressions.error")
    async with running(retry) as rig:
        rig.route(headers, body)
        dead = await rig.settled(1)
        calls = rig.calls[message_id]
    assert len(dead) == 1, f"in the error queue {len(dead)} times"
    [letter] = dead
    arrived = letter.headers
    assert arrived[Header.MESSAGE_ID] == message_id
    assert reason in arrived[Header.ERROR_MESSAGE], arrived[Header.ERROR_MESSAGE]
    assert arrived[Header.ERROR_ATTEMPTS] == str(attempts)
    assert calls == (attempts if order_id == "doomed" else 0)
    if order_id != "doomed":
        assert arrived[Header.ERROR_TYPE] == DECODE_ERROR
    for name, value in extra.items():
        assert arrived.get(mended(name)) == mended(value), (name, arrived)
    for name, value in arrived.items():
        assert mended(name) == name and mended(value) == value, f"not mended: {name!r}"
    assert letter.body == body


@pytest.mark.timeout(60)
async def test_a_body_nested_past_the_recursion_limit_is_refused_at_once() -> None:
    message_id = f"deep-{uuid.uuid4().hex}"
    body = f'{{"order_id": "o-1", "amount": 1, "extra": {nested(DEPTH)}}}'.encode()
    headers = {Header.MESSAGE_ID: message_id, Header.TYPE: ORDER, Header.CONTENT_TYPE: JSON}
    retry = RetryPolicy(immediate=2, delayed=[60.0], error_queue="regressions.error")
    async with running(retry) as rig:
        rig.route(headers, body)
        dead = await rig.settled(1)
    [letter] = dead
    assert letter.headers[Header.ERROR_TYPE] == DECODE_ERROR
    assert "nests too deeply" in letter.headers[Header.ERROR_MESSAGE]
    assert letter.headers[Header.ERROR_ATTEMPTS] == "1"
    assert rig.calls[message_id] == 0


def test_the_source_checks_parse_in_a_fresh_interpreter_after_recursion_errors() -> None:
    with pytest.raises(RecursionError):  # what the decode fuzz provokes, in this process
        msgspec.json.decode(nested(DEPTH).encode())
    parsed = subprocess.run(
        [sys.executable, "-c", "import ast; ast.parse(open('mersal/app.py').read()); print('ok')"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (parsed.returncode, parsed.stdout.strip()) == (0, "ok"), parsed.stderr

    from tests import test_no_unsafe_code as checks

    report = checks.fresh_report.__wrapped__()  # not the cached report: a new interpreter now
    assert report["findings"] == []
    assert ["mersal/cli/run.py", "open_app(args.target)"] in report["load_app_calls"]
    assert any("import pickle" in finding for finding in report["sample"])
