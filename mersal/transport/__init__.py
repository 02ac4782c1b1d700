"""The Transport protocol every broker adapter implements, what it carries, transports by URL."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from mersal.errors import Unsendable
from mersal.messages import Envelope, Header, describe


@dataclass(slots=True)
class Outgoing:
    """One message on its way out: the queue it is sent to, or the topic it is published on."""

    address: str
    envelope: Envelope
    publish: bool = False
    checked: bool = False
    """Checked against the transport's limits already (by the app, when it was sent)."""

    @property
    def delay(self) -> float:
        """Seconds until the message may be delivered, from its deliver-at header."""
        return delay_of(self.envelope)


class Delivery(Protocol):
    """A message received from a queue, owed exactly one ack or nack."""

    envelope: Envelope
    queue: str
    redelivered: bool

    async def ack(self) -> None:
        """Remove the message from the queue: it has been dealt with."""
        ...

    async def nack(self, requeue: bool = True) -> None:
        """Return the message to its queue; `requeue=False` lets the broker dead-letter it."""
        ...


class Consumer(Protocol):
    """A stream of deliveries from one queue, at most `prefetch` unacknowledged at once."""

    async def get(self) -> Delivery:
        """The next delivery, waiting for one."""
        ...

    async def close(self) -> None:
        """Stop receiving; deliveries handed out stay owed, buffered ones go back to the queue."""
        ...


HEADER_ENTRY_BYTES = 8
"""What a header costs on the wire beyond its name and value (AMQP: length fields and a tag)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a transport can carry; every message is checked against them before it is sent.

    The defaults are RabbitMQ's, so that what works on `memory://` works on RabbitMQ too.
    """

    max_body_bytes: int = 134_217_728
    """RabbitMQ's default `max_message_size` (128 MiB)."""
    max_header_bytes: int = 131_072 - 4_096
    """Headers as `header_bytes` counts them: one AMQP frame (131,072) less room for the rest."""
    max_name_bytes: int = 255
    """A queue or topic name: an AMQP short string."""
    max_header_name_bytes: int = 128
    """A header name (RabbitMQ's client library cuts longer ones short without a word)."""
    max_delay: float = 4_200_000.0
    """The longest delay, in seconds (RabbitMQ's TTL cap, rounded down to two digits)."""
    reserved_headers: frozenset[str] = field(default=frozenset({"CC", "BCC"}))
    """Header names the broker acts on (RabbitMQ routes copies by CC and BCC)."""
    plain_names: frozenset[str] = field(init=False, repr=False, compare=False)
    """Mersal's own header names that these limits allow (all but deliver-at, usually)."""
    plain_values_room: int = field(init=False, repr=False, compare=False)
    """Room left for header values when every plain name is there."""

    def __post_init__(self) -> None:
        names = frozenset(
            name
            for name in HEADER_NAMES
            if name != Header.DELIVER_AT
            and name not in self.reserved_headers
            and len(name) <= self.max_header_name_bytes
        )
        room = self.max_header_bytes - sum(len(name) + HEADER_ENTRY_BYTES for name in names)
        object.__setattr__(self, "plain_names", names)
        object.__setattr__(self, "plain_values_room", room)


HEADER_NAMES = frozenset(
    value for name, value in vars(Header).items() if name.isupper() and isinstance(value, str)
)


DEFAULT_LIMITS = Limits()


@runtime_checkable
class Transport(Protocol):
    """Moves envelopes between queues; a broker adapter implements this."""

    address: str
    limits: Limits

    async def start(self) -> None:
        """Connect."""
        ...

    async def stop(self) -> None:
        """Disconnect; unacknowledged deliveries return to their queues."""
        ...

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Make sure `queue` exists (a temporary one goes away when the transport stops).

        `partitions` > 0 splits sends with a partition key over that many ordered partitions
        that several consuming processes share (a transport within one process may ignore it).
        """
        ...

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        ...

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Hand all messages to the broker, in order; raise the first failure if any failed."""
        ...

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Try every message, in order; for each, None once the broker holds it, or why not."""
        ...

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Start receiving from `queue`."""
        ...


async def declare_error_queue(transport: Transport, queue: str) -> None:
    """Make sure the error queue `queue` exists, as the kind of queue the transport parks in.

    A transport with a `declare_error_queue(queue)` method (RabbitMQ: a classic queue, which
    operators can read without the broker counting deliveries) declares it so; others declare
    it as any queue.
    """
    special = getattr(transport, "declare_error_queue", None)
    if special is None:
        await transport.declare(queue)
    else:
        await special(queue)


@runtime_checkable
class BindingPruner(Protocol):
    """A transport that can drop the bindings of subscriptions an app no longer has."""

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Stop delivering to `queue` what is published on any topic not in `topics`."""
        ...


def limits_of(transport: object) -> Limits:
    """The transport's limits (RabbitMQ's defaults for one that declares none)."""
    limits = getattr(transport, "limits", None)
    return limits if isinstance(limits, Limits) else DEFAULT_LIMITS


def first_failure(results: Sequence[Exception | None]) -> None:
    """Raise the first failure of a `send_each`, if there is one."""
    for result in results:
        if result is not None:
            raise result


def delay_of(envelope: Envelope) -> float:
    """Seconds until an envelope's deliver-at time; 0 when it has none or it has passed."""
    deliver_at = envelope.headers.get(Header.DELIVER_AT)
    if deliver_at is None:
        return 0.0
    try:
        delay = float(deliver_at) - time.time()
    except ValueError:
        return 0.0
    return delay if 0.0 < delay < math.inf else 0.0


# What a transport can carry.


def utf8_length(text: str) -> int:
    """The length of `text` in UTF-8; a ValueError if it cannot be encoded (a lone surrogate)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{text[:40]!r} is not valid Unicode text (a lone surrogate?)") from None


def header_bytes(headers: Mapping[str, str]) -> int:
    """The room headers take on the wire, as every transport counts it against its limit."""
    return sum(
        utf8_length(name) + utf8_length(value) + HEADER_ENTRY_BYTES
        for name, value in headers.items()
    )


def check(outgoing: Outgoing, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse (`Unsendable`, saying why) a message the transport could never carry."""
    problem = problem_of(outgoing, limits)
    if problem is not None:
        raise Unsendable(f"cannot send {describe(outgoing.envelope.headers)}: {problem}")


def problem_of(outgoing: Outgoing, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why the transport could never carry `outgoing`, or None if it can (or was checked)."""
    if outgoing.checked or plainly_fine(outgoing, limits):
        return None
    return slow_problem_of(outgoing, limits)


def slow_problem_of(outgoing: Outgoing, limits: Limits) -> str | None:
    """`problem_of` without its shortcuts: each rule in turn."""
    address = outgoing.address
    what = "topic" if outgoing.publish else "queue"
    if not isinstance(address, str) or not address:
        return f"its {what} name {address!r} is not a non-empty string"
    if "\x00" in address:
        return f"its {what} name {address[:100]!r} holds a NUL character"
    try:
        size = utf8_length(address)
    except ValueError as error:
        return f"its {what} name: {error}"
    if size > limits.max_name_bytes:
        return (
            f"its {what} name is {size} bytes long, over the {limits.max_name_bytes} a broker takes"
        )
    envelope = outgoing.envelope
    if not isinstance(envelope.body, bytes | bytearray):
        return f"its body is a {type(envelope.body).__name__}, not bytes"
    if len(envelope.body) > limits.max_body_bytes:
        return (
            f"its body of {len(envelope.body)} bytes is over the {limits.max_body_bytes} the "
            "broker takes"
        )
    problem = _headers_problem(envelope.headers, limits)
    if problem is not None:
        return problem
    deliver_at = envelope.headers.get(Header.DELIVER_AT)
    if deliver_at is not None:
        return delay_problem(deliver_at, limits)
    return None


def plainly_fine(outgoing: Outgoing, limits: Limits) -> bool:
    """The common case, in a few C calls: short ASCII text everywhere, nothing reserved."""
    envelope = outgoing.envelope
    headers = envelope.headers
    address = outgoing.address
    if not (
        type(address) is str
        and address.isascii()
        and 0 < len(address) <= limits.max_name_bytes
        and "\x00" not in address
        and type(envelope.body) is bytes
        and len(envelope.body) <= limits.max_body_bytes
    ):
        return False
    try:
        values = "".join(headers.values())
        if headers.keys() <= limits.plain_names:  # only Mersal's own names
            return values.isascii() and len(values) <= limits.plain_values_room
        names = "".join(headers)
    except TypeError:  # a name or value that is not a string: the slow path says which
        return False
    return (
        names.isascii()
        and values.isascii()
        and len(names) <= limits.max_header_name_bytes  # so is every name
        and "" not in headers
        and len(names) + len(values) + HEADER_ENTRY_BYTES * len(headers) <= limits.max_header_bytes
        and Header.DELIVER_AT not in headers
        and limits.reserved_headers.isdisjoint(headers)
    )


def headers_problem(headers: Mapping[str, str], limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why these headers cannot travel, or None if they can."""
    return _headers_problem(headers, limits)


def _headers_problem(headers: Mapping[str, str], limits: Limits) -> str | None:
    total = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            return f"header name {name!r} is not a non-empty string"
        if not isinstance(value, str):
            return (
                f"header {name[:100]!r} is a {type(value).__name__}, not a string: header values "
                "are strings"
            )
        if name in limits.reserved_headers:
            return f"header {name!r} is reserved by the broker: use another name"
        try:
            name_bytes = utf8_length(name)
            total += name_bytes + utf8_length(value) + HEADER_ENTRY_BYTES
        except ValueError as error:
            return f"header {name[:100]!r}: {error}"
        if name_bytes > limits.max_header_name_bytes:
            return (
                f"header name {name[:40]!r}... is {name_bytes} bytes long, over the "
                f"{limits.max_header_name_bytes} a broker takes"
            )
    if total > limits.max_header_bytes:
        return (
            f"its {len(headers)} headers take {total} bytes, over the {limits.max_header_bytes} "
            "the broker takes: send shorter or fewer header values"
        )
    return None


def delay_problem(deliver_at: str, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why a deliver-at time cannot be honoured, or None if it can."""
    try:
        seconds = float(deliver_at) - time.time()
    except ValueError:
        return f"its {Header.DELIVER_AT} header {deliver_at[:40]!r} is not a time in epoch seconds"
    if not math.isfinite(seconds):
        return f"its {Header.DELIVER_AT} header {deliver_at[:40]!r} is not a finite time"
    if seconds > limits.max_delay:
        return (
            f"its delay of {seconds:.0f}s is over the {limits.max_delay:.0f}s the transport can "
            "hold a message"
        )
    return None


def fit(envelope: Envelope, limits: Limits = DEFAULT_LIMITS, keep: Sequence[str] = ()) -> Envelope:
    """The envelope with headers the transport cannot carry mended, cut or dropped until it can.

    For copies of received messages (a dead letter, a delayed retry), which must leave whatever
    their sender put in the headers. Headers named in `keep` are cut last and never dropped.
    """
    headers: dict[str, str] = {}
    for name, value in envelope.headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            continue
        name, value = _mended(name), _mended(value)
        if not name or name in limits.reserved_headers:
            continue
        if len(name.encode()) > limits.max_header_name_bytes:
            continue
        headers[name] = value
    if header_bytes(headers) > limits.max_header_bytes:
        headers = _shrunk(headers, limits.max_header_bytes, keep)
    return Envelope(headers, envelope.body)


CUT_TO = 1_024
"""Characters a long header value keeps when headers must shrink to fit."""


def _mended(text: str) -> str:
    try:
        utf8_length(text)
    except ValueError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _shrunk(headers: dict[str, str], budget: int, keep: Sequence[str]) -> dict[str, str]:
    """Cut the longest values, then drop headers (others before `keep`), until `budget` holds."""
    kept = set(keep)
    sizes = {name: header_bytes({name: value}) for name, value in headers.items()}
    total = sum(sizes.values())
    by_size = sorted(headers, key=lambda name: (name in kept, -sizes[name]))
    for name in by_size:
        value = headers[name]
        if total <= budget:
            return headers
        if len(value) > CUT_TO:
            cut = f"{value[:CUT_TO]}...[{len(value) - CUT_TO} characters cut]"
            headers[name] = cut
            size = header_bytes({name: cut})
            total -= sizes[name] - size
            sizes[name] = size
    for name in by_size:
        if total <= budget:
            break
        if name not in kept:
            total -= sizes.pop(name)
            del headers[name]
    return headers


# A query parameter carrying a password (asyncpg reads `password` and `sslpassword` there).
_QUERY_PASSWORD = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


def partition_queue(queue: str, index: int) -> str:
    """The name of partition number `index` of a partitioned queue."""
    return f"{queue}.partition.{index}"


_NEXT_URL = re.compile(r";(?=\s*(?:[A-Za-z][A-Za-z0-9+.-]*://|;|$))")


def split_urls(address: str) -> list[str]:
    """The URLs of an address that lists several separated by `;` (a cluster's nodes).

    Only a `;` followed by another URL's scheme (or by nothing, or another `;`) separates, so a
    password may contain one.
    """
    return _NEXT_URL.split(address)


def mask(url: str) -> str:
    """The URL with any password (user info or query) replaced by `***`, fit for logs.

    Several URLs separated by `;` (a cluster's nodes) are masked each.
    """
    urls = split_urls(url)
    if len(urls) > 1:
        return ";".join(mask(part) for part in urls)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    credentials, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}{sep}{user}{':***' if colon else ''}@{host}"
    return _QUERY_PASSWORD.sub(r"\1***", url)
