"""A hostile producer on RabbitMQ, against an app that replies and sends through a SQL outbox.

A raw aio-pika producer publishes deliveries with random headers (every type AMQP carries,
reserved names, names past what a broker keeps, thousands of tiny ones), random reply
addresses (none, empty, long, odd, a queue that does not exist, a requester that is gone) and
random bodies (an Order, garbage, past the app's size cap). The app's handler sends a Shipped
downstream and replies a Receipt, both through its PostgreSQL outbox. For every example:

- each delivery is handled once, or is in the error queue once with why: its body, type or
  size (DecodeError), or a reply address no broker takes (Unsendable); nothing else is there;
- the relay does not stall: the outbox is empty but for the replies to missing queues, parked
  with their reason; a reply to a vanished temporary queue is dropped;
- no message id reaches the downstream (or reply) queue twice, counted without any inbox;
- the app's queue ends empty, nothing is in flight, and the next good message is handled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from mersal import App, Header, MessageContext, RetryPolicy, message
from mersal_sqlalchemy import attach
from tests.fuzz.corpus import order_json, surely_not_an_order
from tests.fuzz.rig import DECODE_ERROR, FUZZ, JSON, ORDER, Order
from tests.fuzz.strategies import attempts, garbage_bodies, over_cap, valid_orders, wrong_fields
from tests.support import RABBITMQ_HOST, eventually, postgres_database

pytestmark = pytest.mark.integration

CAP = 8_192
UNSENDABLE = "mersal.errors.Unsendable"
SHORT_STRING = 255
TEMPORARY_REPLY_TO = "temporary-reply-to"
"""The header that marks a reply address as a requester's temporary queue (on the wire)."""
SETTLE = 15.0

EXPLORE = os.environ.get("MERSAL_FUZZ") == "explore"
HOSTILE = settings(FUZZ, max_examples=150 if EXPLORE else 15)
"""The fuzz settings (derandomized unless MERSAL_FUZZ=explore), with fewer examples: each one
round-trips through RabbitMQ and PostgreSQL."""


@message("hostile.Shipped.v1")
@dataclass
class Shipped:
    """What the handler sends downstream for each Order it handles."""

    source: str


@message("hostile.Receipt.v1")
@dataclass
class Receipt:
    """What the handler replies for each Order it handles."""

    source: str


# What the producer draws.

STRUCTURED = frozenset(
    {
        Header.TYPE,
        Header.CONTENT_TYPE,
        Header.MESSAGE_ID,
        Header.REPLY_TO,
        TEMPORARY_REPLY_TO,
        "CC",
        "BCC",
    }
)
"""Header names the strategies below set on purpose; random extras leave them alone."""

KNOWN_NAMES = [
    Header.ATTEMPT,
    Header.DELIVER_AT,
    Header.PARTITION_KEY,
    Header.CORRELATION_ID,
    Header.CAUSATION_ID,
    Header.SOURCE,
    Header.SENT_AT,
    Header.ERROR_TYPE,
    Header.ERROR_MESSAGE,
    Header.ERROR_ATTEMPTS,
    "x-death",
    "x-first-death-queue",
    "x-delay",
    "",
]

_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)
# pamqp packs a float in 32 bits; NaN and infinities crash the broker's channel.
_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
header_values: st.SearchStrategy[Any] = st.one_of(
    _text,
    st.integers(300, 12_000).map(lambda n: "v" * n),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    _finite,
    st.none(),
    st.binary(max_size=30).map(bytearray),
    st.lists(_text | st.integers(-1_000, 1_000), max_size=4),
    st.dictionaries(st.text(max_size=8), st.integers(-1_000, 1_000) | _text, max_size=3),
)
"""Every kind of value a raw AMQP producer can put in a header (aio-pika/pamqp encode these)."""

header_names = st.one_of(
    _text,
    st.sampled_from(KNOWN_NAMES),
    st.integers(129, 200).map(lambda n: "n" * n),  # pamqp cuts names to 128 bytes, silently
).filter(lambda name: name not in STRUCTURED)

extra_headers = st.dictionaries(header_names, header_values, max_size=6) | st.fixed_dictionaries(
    {Header.ATTEMPT: attempts}
)

BODIES = st.one_of(
    st.tuples(valid_orders, st.just(True)),
    st.tuples(st.just(order_json().ljust(CAP)), st.just(True)),  # exactly at the cap
    st.tuples(wrong_fields, st.just(False)),
    st.tuples(garbage_bodies.filter(surely_not_an_order), st.just(False)),
    st.tuples(over_cap, st.just(False)),
)
"""(body, whether it is an Order when within the cap)."""

TYPES = st.sampled_from(
    [
        ("property", ORDER),
        ("property", ORDER),
        ("header", ORDER),
        ("header", bytearray(ORDER.encode())),
        ("none", None),
        ("property", "hostile.Nobody.v1"),
        ("header", "t" * 300),
        ("header", 5),
        ("header", [ORDER]),
    ]
)
CONTENT_TYPES = st.sampled_from(
    [
        ("none", None),
        ("property", JSON),
        ("header", "Application/JSON; charset=utf-8"),
        ("header", "text/plain"),
        ("property", "application/x-python-pickle"),
        ("header", bytearray(JSON.encode())),
    ]
)
MESSAGE_IDS = st.sampled_from(["property", "header", "bytes", "long", "list", "nul"])
REPLIES = st.sampled_from(
    [
        "none",
        "empty",
        "existing",
        "existing-bytes",
        "existing-temporary",
        "missing",
        "missing-temporary",
        "long",
        "list",
    ]
)


@dataclass(frozen=True)
class Shape:
    """One raw delivery as drawn, before the rig gives it an id of its own."""

    body: bytes
    body_ok: bool
    type_: tuple[str, Any]
    content_type: tuple[str, Any]
    message_id: str
    reply: str
    odd: str
    extras: dict[str, Any]
    reserved: dict[str, list[str]]
    tiny: int


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    """A raw delivery a hostile producer might send."""
    body, body_ok = draw(BODIES)
    return Shape(
        body=body,
        body_ok=body_ok,
        type_=draw(TYPES),
        content_type=draw(CONTENT_TYPES),
        message_id=draw(MESSAGE_IDS),
        reply=draw(REPLIES),
        odd=draw(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)),
        extras=draw(extra_headers),
        reserved=draw(
            st.fixed_dictionaries(
                {},
                optional={"CC": st.just(["gone-cc"]), "BCC": st.just(["gone-bcc"]) | st.just([])},
            )
        ),
        tiny=draw(st.sampled_from([0, 0, 0, 2_000])),
    )


# What must become of it.

HANDLED = "handled"


@dataclass(frozen=True)
class Planned:
    """A delivery ready to publish, and what must become of it."""

    message: aio_pika.Message
    message_id: str
    """The id the app reads (its header, else the AMQP property)."""
    fate: str
    """HANDLED, or a fragment of the reason it must be dead-lettered with."""
    error_type: str | None
    reply: str | None
    """Where its reply goes: "delivered", "parked", "dropped", or None (no reply)."""
    reply_to: str | None
    or_refused: bool = False
    """Refusing the reply at the call (Unsendable, so dead-lettered) is fine too: its address
    holds a NUL, which a broker routes but a PostgreSQL text column cannot store."""


def _text_of(value: Any) -> str | None:
    """A header value as the app reads it (see mersal_rabbitmq.wire.header_text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return None


def _media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def decode_refusal(type_name: str | None, content_type: str | None, shape: Shape) -> str | None:
    """Why the decode step refuses the delivery (in the order it checks), or None."""
    if len(shape.body) > CAP:
        return f"over the {CAP}-byte cap"
    if not type_name:
        return "no type header"
    if content_type and _media_type(content_type) != JSON:
        return "content type"
    if type_name != ORDER:
        return "unknown message type"
    if not shape.body_ok:
        return "body"
    return None


def plan(shape: Shape, probe: str, prefix: str, replies: str) -> Planned:
    """The raw message for `shape`, with ids made unique by `probe`, and its expected fate."""
    headers: dict[str, Any] = {f"t{n:04d}": "tiny" for n in range(shape.tiny)}
    headers.update(shape.extras)
    headers.update(shape.reserved)
    properties: dict[str, Any] = {}

    def place(kind: str, header: str, prop: str, value: Any) -> str | None:
        if kind == "property":
            properties[prop] = value
            return str(value)
        if kind == "header":
            headers[header] = value
            return _text_of(value)
        return None

    type_name = place(shape.type_[0], Header.TYPE, "type", shape.type_[1])
    kind, value = shape.content_type
    content_type = place(kind, Header.CONTENT_TYPE, "content_type", value)

    message_id = {
        "property": probe,
        "header": f"{probe}-header",
        "bytes": f"{probe}-bytes",
        "long": probe + "m" * 600,
        "list": probe,
        "nul": f"{probe}\x00nul",
    }[shape.message_id]
    if shape.message_id in ("property", "list"):
        properties["message_id"] = probe
        if shape.message_id == "list":
            headers[Header.MESSAGE_ID] = [probe, "another"]
    elif shape.message_id == "bytes":
        headers[Header.MESSAGE_ID] = bytearray(message_id.encode())
    else:
        headers[Header.MESSAGE_ID] = message_id

    gone = f"{prefix}.gone.{probe[:8]}.{shape.odd}"
    reply_to: str | None = None
    if shape.reply == "empty":
        headers[Header.REPLY_TO] = reply_to = ""
    elif shape.reply in ("existing", "existing-temporary"):
        properties["reply_to"] = reply_to = replies
    elif shape.reply == "existing-bytes":
        headers[Header.REPLY_TO] = bytearray(replies.encode())
        reply_to = replies
    elif shape.reply in ("missing", "missing-temporary"):
        properties["reply_to"] = reply_to = gone
    elif shape.reply == "long":
        headers[Header.REPLY_TO] = reply_to = f"{prefix}.gone." + "L" * SHORT_STRING
    elif shape.reply == "list":
        headers[Header.REPLY_TO] = [replies]
    if shape.reply.endswith("-temporary"):
        headers[TEMPORARY_REPLY_TO] = "true"

    outgoing = aio_pika.Message(shape.body, headers=headers, **properties)
    refusal = decode_refusal(type_name, content_type, shape)
    if refusal is not None:
        return Planned(outgoing, message_id, refusal, DECODE_ERROR, None, reply_to)
    if reply_to and len(reply_to.encode()) > SHORT_STRING:
        return Planned(outgoing, message_id, "over the 255", UNSENDABLE, None, reply_to)
    reply: str | None = None
    if reply_to:
        if reply_to == replies:
            reply = "delivered"
        else:
            reply = "dropped" if shape.reply.endswith("-temporary") else "parked"
    nul = reply is not None and "\x00" in (reply_to or "")
    return Planned(outgoing, message_id, HANDLED, None, reply, reply_to, or_refused=nul)


GOOD = Shape(
    order_json(), True, ("property", ORDER), ("none", None), "property", "none", "", {}, {}, 0
)
"""A well-formed Order without a reply address: every batch ends with one."""

AFTER = [
    dataclasses.replace(GOOD, reply="existing"),
    dataclasses.replace(GOOD, type_=("property", "hostile.Nobody.v1")),
]
"""Sent once a batch settled, through every queue the rig watches (downstream, replies, the
error queue): a copy of the batch's sent twice would arrive there before these."""


@dataclass(frozen=True)
class Unsettled:
    """What keeps a batch from being settled: false, so that `eventually` keeps waiting."""

    outbox_waiting: int
    parked: int
    expected_parked: int
    dropped: int
    expected_dropped: int
    in_flight: int
    unaccounted_for: int
    first_unaccounted_for: str

    def __bool__(self) -> bool:
        return False


# The rig: one app for every example of a test, on its own event loop.


class Recorder:
    """Every message a raw consumer received from one queue."""

    def __init__(self) -> None:
        self.ids: Counter[str] = Counter()
        self.by_id: dict[str, list[AbstractIncomingMessage]] = {}
        self.sources: Counter[str] = Counter()

    async def on_message(self, incoming: AbstractIncomingMessage) -> None:
        """Count one delivery (auto-acked) by message id and, for ours, by source."""
        headers = incoming.headers or {}
        # The header first, as Mersal reads it: an id too long for the AMQP property travels in
        # the header, and aiormq then puts a random id of its own in the property.
        message_id = _text_of(headers.get(Header.MESSAGE_ID)) or incoming.message_id or ""
        self.ids[message_id] += 1
        self.by_id.setdefault(message_id, []).append(incoming)
        try:
            source = json.loads(incoming.body).get("source")
        except (ValueError, AttributeError):
            source = None
        if isinstance(source, str):
            self.sources[source] += 1


@dataclass
class Rig:
    """An app on RabbitMQ and PostgreSQL whose Order handler sends and replies via the outbox."""

    url: str
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    prefix: str = field(default_factory=lambda: f"hostile-{uuid.uuid4().hex[:10]}")
    calls: Counter[str] = field(default_factory=Counter)
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)
    earlier: set[str] = field(default_factory=set)
    """Message ids of the earlier examples (and the first batch)."""

    def __post_init__(self) -> None:
        self.name = self.prefix
        self.error_queue = f"{self.prefix}.error"
        self.downstream = f"{self.prefix}.downstream"
        self.replies = f"{self.prefix}.replies"
        self.policy = RetryPolicy(immediate=0, delayed=[0.05], error_queue=self.error_queue)

    def start(self) -> None:
        """Create the database and queues, start the app, and run a first batch."""
        self.loop.run_until_complete(self._start())
        self.check([GOOD])

    async def _start(self) -> None:
        database = await self.stack.enter_async_context(postgres_database(migrate=True))
        self.connection: AbstractConnection = await aio_pika.connect(self.url)
        self.channel: AbstractChannel = await self.connection.channel()
        for queue in (self.downstream, self.replies):
            await self.channel.declare_queue(queue, durable=True)
        app = self.app = App(
            self.name,
            transport=self.url,
            database=database,
            retry=self.policy,
            max_body_size=CAP,
            concurrency=8,
        )
        self.storage = attach(app, poll_interval=0.2)
        calls = self.calls

        async def take_order(message: Order, context: MessageContext) -> None:
            calls[context.message_id] += 1
            await context.app.send(Shipped(context.message_id))
            if context.reply_to:
                await context.app.reply(Receipt(context.message_id))

        app.register(Order, take_order)
        app.route(Shipped, self.downstream)
        await app.start()
        self.recorders = {
            queue: await self._record(queue)
            for queue in (self.downstream, self.replies, self.error_queue)
        }

    async def _record(self, queue: str) -> Recorder:
        recorder = Recorder()
        amqp_queue = await self.channel.get_queue(queue, ensure=False)
        await amqp_queue.consume(recorder.on_message, no_ack=True)
        return recorder

    def stop(self) -> None:
        """Stop the app; nothing may be left in its queue; drop the queues and the database."""
        try:
            self.loop.run_until_complete(self._stop())
        finally:
            self.loop.close()

    async def _stop(self) -> None:
        app: App | None = getattr(self, "app", None)
        try:
            if app is not None:
                await app.stop()
                # Stopped: a delivery the app had left unacknowledged would be back in its queue.
                declared = await self.channel.declare_queue(self.name, passive=True)
                assert declared.declaration_result.message_count == 0, "deliveries left behind"
        finally:
            if hasattr(self, "connection"):
                made = app.transport.queues if app is not None else []  # type: ignore[attr-defined]
                channel = await self.connection.channel()
                for queue in {*made, self.downstream, self.replies}:
                    await channel.queue_delete(queue)
                await self.connection.close()
            await self.stack.aclose()

    def check(self, drawn: list[Shape]) -> None:
        """Publish the batch and a good message after it; assert every invariant."""
        self.loop.run_until_complete(self._check([*drawn, GOOD]))

    async def _check(self, drawn: list[Shape]) -> None:
        relay = self.storage.relay
        assert relay is not None
        dropped_before = relay.dropped
        await self._purge_parked()  # what an example that failed part way left
        planned = [plan(one, uuid.uuid4().hex, self.prefix, self.replies) for one in drawn]
        ours = {one.message_id for one in planned}
        for one in planned:
            await self.channel.default_exchange.publish(one.message, self.name)
        try:
            await self._settle(planned, dropped_before)
            await self._move_on()
            await self._assert_outcomes(planned, dropped_before)
        finally:
            self.earlier |= ours
        await self._purge_parked()

    async def _move_on(self) -> None:
        """Send AFTER and wait until it settled: what the batch sent twice is in by then."""
        relay = self.storage.relay
        assert relay is not None
        dropped_before = relay.dropped
        after = [plan(one, uuid.uuid4().hex, self.prefix, self.replies) for one in AFTER]
        self.earlier |= {one.message_id for one in after}
        for one in after:
            await self.channel.default_exchange.publish(one.message, self.name)
        await self._settle(after, dropped_before)

    async def _settle(self, planned: list[Planned], dropped_before: int) -> None:
        """Wait until every delivery came to its end and the outbox has nothing left to send."""
        await eventually(
            lambda: self._settled(planned, dropped_before),
            "every delivery handled or dead-lettered and the outbox sent, parked or dropped",
            timeout=SETTLE,
            interval=0.02,
        )

    async def _settled(self, planned: list[Planned], dropped_before: int) -> bool | Unsettled:
        """True once settled; else what is left. A handled one dead-lettered fails at once."""
        downstream, replies, errors = (
            self.recorders[q] for q in (self.downstream, self.replies, self.error_queue)
        )
        relay = self.storage.relay
        assert relay is not None
        instead = self._refused_instead(planned)
        expected_parked, expected_dropped = _replies_kept(planned, instead)
        missing: list[str] = []
        for one in planned:
            if one.message_id in instead:
                continue
            if one.fate == HANDLED:
                if one.message_id in errors.ids:
                    letter = errors.by_id[one.message_id][0]
                    raise AssertionError(
                        f"dead-lettered, not handled: {_reason(letter)}: {one!r:.600}"
                    )
                done = downstream.sources[one.message_id] and (
                    one.reply != "delivered" or replies.sources[one.message_id]
                )
            else:
                done = bool(errors.ids[one.message_id])
            if not done:
                missing.append(f"{one.fate}: {one!r:.300}")
        addresses = {one.reply_to for one in planned}
        left = Unsettled(
            outbox_waiting=await self.storage.pending(),
            parked=sum(address in addresses for address, _ in await self._parked()),
            expected_parked=expected_parked,
            dropped=relay.dropped - dropped_before,
            expected_dropped=expected_dropped,
            in_flight=self.app.in_flight,
            unaccounted_for=len(missing),
            first_unaccounted_for=missing[0] if missing else "",
        )
        settled = (
            not missing
            and not left.outbox_waiting
            and left.parked == expected_parked
            and left.dropped == expected_dropped
            and not left.in_flight
        )
        return settled or left

    async def _assert_outcomes(self, planned: list[Planned], dropped_before: int) -> None:
        downstream, replies, errors = (
            self.recorders[q] for q in (self.downstream, self.replies, self.error_queue)
        )
        ours = {one.message_id for one in planned}
        instead = self._refused_instead(planned)
        for one in planned:
            what = f"{one!r:.600}"
            if one.fate == HANDLED and one.message_id not in instead:
                assert self.calls[one.message_id] == 1, (
                    f"handled {self.calls[one.message_id]}x: {what}"
                )
                assert errors.ids[one.message_id] == 0, what
                assert downstream.sources[one.message_id] == 1, what
                expected_replies = 1 if one.reply == "delivered" else 0
                assert replies.sources[one.message_id] == expected_replies, what
                continue
            calls = self.calls[one.message_id]
            if one.error_type == DECODE_ERROR:
                assert calls == 0, f"a handler ran for a refused delivery: {what}"
            else:
                assert 0 < calls <= self.policy.max_attempts, f"handled {calls}x: {what}"
            assert errors.ids[one.message_id] == 1, (
                f"in the error queue {errors.ids[one.message_id]}x: {what}"
            )
            [letter] = errors.by_id[one.message_id]
            headers = letter.headers or {}
            if one.message_id in instead:
                continue  # dead-lettered as Unsendable, which _refused_instead checked
            assert headers[Header.ERROR_TYPE] == one.error_type, (_reason(letter), what)
            assert one.fate in str(headers[Header.ERROR_MESSAGE]), (_reason(letter), what)
            assert headers[Header.ERROR_QUEUE] == self.name
            assert letter.body == one.message.body, f"the body changed: {what}"
            assert downstream.sources[one.message_id] == 0, f"a refused delivery sent: {what}"
            assert replies.sources[one.message_id] == 0, what
        strays = set(errors.ids) - ours - self.earlier
        assert not strays, f"unexpected dead letters: {sorted(strays)[:3]}"
        for recorder in (downstream, replies, errors):
            twice = {i: n for i, n in recorder.ids.items() if n > 1}
            assert not twice, f"message ids received more than once: {twice}"
        parked = await self._parked()
        addresses = {one.reply_to for one in planned}
        expected = Counter(
            one.reply_to
            for one in planned
            if one.reply == "parked" and one.message_id not in instead
        )
        assert Counter(address for address, _ in parked if address in addresses) == expected
        assert all(reason and "Unroutable" in reason for _, reason in parked), parked
        relay = self.storage.relay
        assert relay is not None
        assert relay.dropped - dropped_before == _replies_kept(planned, instead)[1]
        declared = await self.channel.declare_queue(self.name, passive=True)
        assert declared.declaration_result.message_count == 0
        assert self.app.in_flight == 0

    def _refused_instead(self, planned: list[Planned]) -> set[str]:
        """Ids of the deliveries that may be refused instead of handled, and were (Unsendable)."""
        errors = self.recorders[self.error_queue]
        return {
            one.message_id
            for one in planned
            if one.or_refused
            and errors.ids[one.message_id]
            and (errors.by_id[one.message_id][0].headers or {}).get(Header.ERROR_TYPE) == UNSENDABLE
        }

    async def _parked(self) -> list[tuple[str, str | None]]:
        """The app's parked outbox rows: address and reason."""
        table = self.storage.tables.outbox
        query = select(table.c.address, table.c.parked_reason).where(
            table.c.app == self.name, table.c.parked_at.is_not(None)
        )
        async with self.storage.engine.connect() as connection:
            return [(row.address, row.parked_reason) for row in await connection.execute(query)]

    async def _purge_parked(self) -> None:
        """Delete the parked rows (as `mersal outbox purge` would), so each example starts clean."""
        table = self.storage.tables.outbox
        async with self.storage.engine.begin() as connection:
            await connection.execute(
                delete(table).where(table.c.app == self.name, table.c.parked_at.is_not(None))
            )


def _replies_kept(planned: list[Planned], instead: set[str]) -> tuple[int, int]:
    """How many replies must be parked, and how many dropped, of those that were written."""
    written = [one for one in planned if one.message_id not in instead]
    return (
        sum(one.reply == "parked" for one in written),
        sum(one.reply == "dropped" for one in written),
    )


def _reason(letter: AbstractIncomingMessage) -> str:
    headers = letter.headers or {}
    message = _text_of(headers.get(Header.ERROR_MESSAGE)) or ""
    return f"{_text_of(headers.get(Header.ERROR_TYPE))}: {message[:300]}"


@pytest.fixture
def rig(vhost: str) -> Iterator[Rig]:
    """A started app on the session's vhost and a database of its own; cleaned up after."""
    started = Rig(f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}")
    try:
        started.start()
        yield started
    finally:
        started.stop()


def order(**changes: Any) -> Shape:
    """A well-formed Order (its id in the AMQP property, no reply), with `changes`."""
    return dataclasses.replace(GOOD, **changes)


EXAMPLES = [
    # Replies: to a queue that exists, to one that does not (parked), to a requester that is
    # gone (dropped), to an address no broker takes (refused at the call, dead-lettered).
    order(reply="existing", reserved={"CC": ["gone-cc"], "BCC": []}),
    order(reply="missing", odd="odd #*.ü", extras={"x-death": [{"count": 1}], "": "empty"}),
    order(message_id="bytes", reply="missing-temporary", extras={Header.ATTEMPT: "9" * 30}),
    order(message_id="long", reply="long", tiny=2_000, extras={Header.ATTEMPT: "0"}),
    order(message_id="header", reply="existing-bytes", extras={"n" * 200: 5, "x": None}),
]
"""Deliveries every run tries first, whatever Hypothesis draws."""

NUL_EXAMPLES = [order(message_id="nul"), order(reply="missing", odd="nul\x00queue")]
"""What a PostgreSQL text column cannot hold: a NUL in the message id, in the reply address."""


@pytest.mark.timeout(150)
@HOSTILE
@given(st.lists(shapes(), min_size=1, max_size=6))
@example(EXAMPLES)
@example(NUL_EXAMPLES)
def test_whatever_a_hostile_producer_sends_nothing_stalls_loops_or_arrives_twice(
    rig: Rig, drawn: list[Shape]
) -> None:
    rig.check(drawn)
