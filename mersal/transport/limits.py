"""What a transport can carry: its Limits, the rules every message is checked by, and `fit`.

Each rule is two functions side by side: a cheap accept, a few C calls that take what is
plainly fine (short ASCII text, nothing reserved), and the reasons it looks for once that
fails. The send path runs only the cheap accepts of a typical message (`plainly_sendable`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mersal.errors import Unsendable
from mersal.messages import Envelope, Header, describe


class Sendable(Protocol):
    """A message on its way out, as the limits see it (a `mersal.transport.Outgoing`)."""

    @property
    def address(self) -> str:
        """The queue it is sent to, or the topic it is published on."""
        ...

    @property
    def envelope(self) -> Envelope:
        """Its headers and body."""
        ...

    @property
    def publish(self) -> bool:
        """Whether `address` is a topic."""
        ...

    @property
    def checked(self) -> bool:
        """Whether the app checked it against the limits already."""
        ...


HEADER_ENTRY_BYTES = 8
"""What a header costs on the wire beyond its name and value (AMQP: length fields and a tag)."""

HEADER_NAMES = frozenset(
    value for name, value in vars(Header).items() if name.isupper() and isinstance(value, str)
)
"""Mersal's own header names."""


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
    """Mersal's own header names that these limits allow (all of them, usually)."""
    plain_values_room: int = field(init=False, repr=False, compare=False)
    """Room left for header values when every plain name is there."""

    def __post_init__(self) -> None:
        names = frozenset(
            name
            for name in HEADER_NAMES
            if name not in self.reserved_headers and len(name) <= self.max_header_name_bytes
        )
        room = self.max_header_bytes - sum(len(name) + HEADER_ENTRY_BYTES for name in names)
        object.__setattr__(self, "plain_names", names)
        object.__setattr__(self, "plain_values_room", room)


DEFAULT_LIMITS = Limits()
"""RabbitMQ's limits, for a transport that declares none."""


def limits_of(transport: object) -> Limits:
    """The transport's limits (RabbitMQ's defaults for one that declares none)."""
    limits = getattr(transport, "limits", None)
    return limits if isinstance(limits, Limits) else DEFAULT_LIMITS


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


# Checking a message.


def check_sendable(outgoing: Sendable, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse (`Unsendable`, saying why) a message the transport could never carry."""
    problem = problem_of(outgoing, limits)
    if problem is not None:
        raise Unsendable(f"cannot send {describe(outgoing.envelope.headers)}: {problem}")


def problem_of(outgoing: Sendable, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why the transport could never carry `outgoing`, or None if it can (or was checked)."""
    if outgoing.checked or plainly_sendable(outgoing, limits):
        return None
    for accepts, problem_in in RULES:
        if not accepts(outgoing, limits) and (problem := problem_in(outgoing, limits)):
            return problem
    return None


def plainly_sendable(outgoing: Sendable, limits: Limits) -> bool:
    """Whether the cheap accept of every rule in RULES takes `outgoing`: the common case."""
    return (
        plain_name(outgoing, limits)
        and plain_body(outgoing, limits)
        and plain_headers(outgoing, limits)
        and undelayed(outgoing, limits)
    )


# The rules: each a cheap accept, then the reasons it looks for.


def plain_name(outgoing: Sendable, limits: Limits) -> bool:
    """A short ASCII queue or topic name without NUL."""
    name = outgoing.address
    return (
        type(name) is str
        and name.isascii()
        and 0 < len(name) <= limits.max_name_bytes
        and "\x00" not in name
    )


def name_problem(outgoing: Sendable, limits: Limits) -> str | None:
    """Why the queue or topic name cannot travel, or None if it can."""
    name = outgoing.address
    what = "topic" if outgoing.publish else "queue"
    if not isinstance(name, str) or not name:
        return f"its {what} name {name!r} is not a non-empty string"
    if "\x00" in name:
        return f"its {what} name {name[:100]!r} holds a NUL character"
    try:
        size = utf8_length(name)
    except ValueError as error:
        return f"its {what} name: {error}"
    if size > limits.max_name_bytes:
        return (
            f"its {what} name is {size} bytes long, over the {limits.max_name_bytes} a broker takes"
        )
    return None


def plain_body(outgoing: Sendable, limits: Limits) -> bool:
    """A body of bytes within the limit."""
    body = outgoing.envelope.body
    return type(body) is bytes and len(body) <= limits.max_body_bytes


def body_problem(outgoing: Sendable, limits: Limits) -> str | None:
    """Why the body cannot travel, or None if it can."""
    body = outgoing.envelope.body
    if not isinstance(body, bytes | bytearray):
        return f"its body is a {type(body).__name__}, not bytes"
    if len(body) > limits.max_body_bytes:
        return f"its body of {len(body)} bytes is over the {limits.max_body_bytes} the broker takes"
    return None


def plain_headers(outgoing: Sendable, limits: Limits) -> bool:
    """Short ASCII names and values, nothing reserved, within the room (counted in one join)."""
    headers = outgoing.envelope.headers
    try:
        values = "".join(headers.values())
        if headers.keys() <= limits.plain_names:  # only Mersal's own names
            return values.isascii() and len(values) <= limits.plain_values_room
        names = "".join(headers)
    except TypeError:  # a name or value that is not a string: the reasons say which
        return False
    return (
        names.isascii()
        and values.isascii()
        and len(names) <= limits.max_header_name_bytes  # so is every name
        and "" not in headers
        and len(names) + len(values) + HEADER_ENTRY_BYTES * len(headers) <= limits.max_header_bytes
        and limits.reserved_headers.isdisjoint(headers)
    )


def headers_problem(outgoing: Sendable, limits: Limits) -> str | None:
    """Why the headers cannot travel, or None if they can."""
    headers = outgoing.envelope.headers
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


def undelayed(outgoing: Sendable, limits: Limits) -> bool:
    """No deliver-at time to honour."""
    return Header.DELIVER_AT not in outgoing.envelope.headers


def delay_problem(outgoing: Sendable, limits: Limits) -> str | None:
    """Why the deliver-at time cannot be honoured, or None if it can."""
    deliver_at = outgoing.envelope.headers.get(Header.DELIVER_AT)
    if deliver_at is None:
        return None
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


Rule = tuple[Callable[[Sendable, Limits], bool], Callable[[Sendable, Limits], str | None]]
"""A rule: its cheap accept, and the reasons it looks for when that does not take a message."""

RULES: tuple[Rule, ...] = (
    (plain_name, name_problem),
    (plain_body, body_problem),
    (plain_headers, headers_problem),
    (undelayed, delay_problem),
)
"""Every rule a message is checked by, in the order its problems are reported."""


# Mending copies of received messages.


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
