"""AMQP 1.0's type system, by hand: the message we write, and any message's sections read.

Proton's `Message.encode` and `decode` convert every property through its Python wrappers,
about 25 µs a message each way; a message is a few described sections of primitive types, so
writing ours and reading any takes a fraction of that in plain Python. What this reader cannot
read (bytes that are not AMQP 1.0, an encoding it has no code for) raises `Unknown` (a
ValueError), and the consumer dead-letters the message whole with that reason.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

HEADER, DELIVERY_ANNOTATIONS, MESSAGE_ANNOTATIONS, PROPERTIES = 0x70, 0x71, 0x72, 0x73
APPLICATION_PROPERTIES, DATA, SEQUENCE, VALUE, FOOTER = 0x74, 0x75, 0x76, 0x77, 0x78

_DURABLE_HEADER = b"\x00\x53\x70\xc0\x02\x01\x41"  # header [durable=true]
_NULL = b"\x40"


class Unknown(ValueError):
    """An encoding this reader does not know, or bytes that are not an AMQP 1.0 message."""


class Symbol(str):
    """An AMQP symbol (an ASCII name, such as a content type)."""


@dataclass(slots=True)
class Sections:
    """A message's sections as read: header and properties fields, application properties, body.

    `body` is the data section's bytes, or the value of an amqp-value section; `body_raw`, the
    encoded body section(s) when the body is anything else (a sequence, several data sections);
    `encoded_body()` the body section(s) as they came.
    """

    header: list[Any] = field(default_factory=list)
    properties: list[Any] = field(default_factory=list)
    application_properties: dict[Any, Any] = field(default_factory=dict)
    body: Any = None
    body_raw: bytes | None = None
    raw: bytes = b""
    body_span: tuple[int, int] = (0, 0)

    def encoded_body(self) -> bytes:
        """The body section(s), encoded as they arrived."""
        start, end = self.body_span
        return self.raw[start:end]


# Writing.


def message(
    properties: Mapping[str, str],
    *,
    message_id: str | None,
    subject: str | None,
    reply_to: str | None,
    correlation_id: str | None,
    content_type: str | None,
    creation_time: float | None,
    body: bytes,
) -> bytes:
    """A durable message: the standard properties given, `properties`, one data section."""
    fields = [
        _string(message_id),
        _NULL,  # user-id
        _NULL,  # to
        _string(subject),
        _string(reply_to),
        _string(correlation_id),
        _symbol(content_type),
        _NULL,  # content-encoding
        _NULL,  # absolute-expiry-time
        _NULL
        if creation_time is None
        else b"\x83" + struct.pack(">q", round(creation_time * 1000)),
    ]
    while fields and fields[-1] is _NULL:
        fields.pop()
    parts = [_DURABLE_HEADER, b"\x00\x53\x73", _compound(0xD0, fields)]
    if properties:
        pairs = [_string(text) for item in properties.items() for text in item]
        parts += [b"\x00\x53\x74", _compound(0xD1, pairs)]
    parts += [b"\x00\x53\x75", b"\xb0", struct.pack(">I", len(body)), body]
    return b"".join(parts)


def _string(text: str | None) -> bytes:
    if text is None:
        return _NULL
    encoded = text.encode()
    if len(encoded) < 256:
        return b"\xa1" + bytes((len(encoded),)) + encoded
    return b"\xb1" + struct.pack(">I", len(encoded)) + encoded


def _symbol(text: str | None) -> bytes:
    if text is None or not text.isascii():
        return _NULL  # a symbol is ASCII; the header still carries it
    encoded = text.encode()
    if len(encoded) < 256:
        return b"\xa3" + bytes((len(encoded),)) + encoded
    return b"\xb3" + struct.pack(">I", len(encoded)) + encoded


def _compound(code: int, items: list[bytes]) -> bytes:
    """A list32 (0xd0) or map32 (0xd1) of encoded items."""
    body = b"".join(items)
    return bytes((code,)) + struct.pack(">II", len(body) + 4, len(items)) + body


# Reading.


def sections(data: bytes | bytearray | memoryview) -> Sections:
    """The sections of an encoded message; raises Unknown for what this reader cannot read."""
    reader = _Reader(bytes(data))
    found = Sections()
    bodies: list[tuple[int, int]] = []  # where each body section starts and ends
    kinds: set[int] = set()
    while reader.at < len(reader.data):
        start = reader.at
        if reader.byte() != 0x00:
            raise Unknown(f"byte {start}: a section must be a described type")
        descriptor = reader.value()
        code = _section_code(descriptor)
        value = reader.body() if code in (SEQUENCE, VALUE) else reader.value()
        if code == HEADER and isinstance(value, list):
            found.header = value
        elif code == PROPERTIES and isinstance(value, list):
            found.properties = value
        elif code == APPLICATION_PROPERTIES and isinstance(value, dict):
            found.application_properties = value
        elif code in (DATA, SEQUENCE, VALUE):
            if code == DATA and not isinstance(value, bytes):
                raise Unknown("a data section must hold binary")
            bodies.append((start, reader.at))
            kinds.add(code)
            found.body = value
        elif code in (DELIVERY_ANNOTATIONS, MESSAGE_ANNOTATIONS, FOOTER):
            continue
        else:
            raise Unknown(f"byte {start}: section {descriptor!r} holds {type(value).__name__}")
        if code == FOOTER:
            break
    found.raw = reader.data
    if bodies:
        found.body_span = (bodies[0][0], bodies[-1][1])
    if len(bodies) > 1 or SEQUENCE in kinds:
        found.body_raw = found.encoded_body()
        found.body = None
    return found


def _section_code(descriptor: Any) -> int:
    if isinstance(descriptor, int) and (descriptor >> 32) == 0:
        return descriptor
    names = {
        "amqp:header:list": HEADER,
        "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
        "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
        "amqp:properties:list": PROPERTIES,
        "amqp:application-properties:map": APPLICATION_PROPERTIES,
        "amqp:data:binary": DATA,
        "amqp:amqp-sequence:list": SEQUENCE,
        "amqp:amqp-value:*": VALUE,
        "amqp:footer:map": FOOTER,
    }
    if isinstance(descriptor, str) and descriptor in names:
        return names[descriptor]
    raise Unknown(f"unknown section descriptor {descriptor!r}")


@dataclass(frozen=True, slots=True)
class Described:
    """A described value that is not a section (in an annotation or a body)."""

    descriptor: Any
    value: Any


_FIXED: dict[int, tuple[int, Callable[[bytes], Any]]] = {
    0x50: (1, lambda raw: raw[0]),
    0x51: (1, lambda raw: struct.unpack(">b", raw)[0]),
    0x52: (1, lambda raw: raw[0]),
    0x53: (1, lambda raw: raw[0]),
    0x54: (1, lambda raw: struct.unpack(">b", raw)[0]),
    0x55: (1, lambda raw: struct.unpack(">b", raw)[0]),
    0x56: (1, lambda raw: raw[0] != 0),
    0x60: (2, lambda raw: struct.unpack(">H", raw)[0]),
    0x61: (2, lambda raw: struct.unpack(">h", raw)[0]),
    0x70: (4, lambda raw: struct.unpack(">I", raw)[0]),
    0x71: (4, lambda raw: struct.unpack(">i", raw)[0]),
    0x72: (4, lambda raw: struct.unpack(">f", raw)[0]),
    0x73: (4, lambda raw: chr(struct.unpack(">I", raw)[0])),
    0x74: (4, bytes),
    0x80: (8, lambda raw: struct.unpack(">Q", raw)[0]),
    0x81: (8, lambda raw: struct.unpack(">q", raw)[0]),
    0x82: (8, lambda raw: struct.unpack(">d", raw)[0]),
    0x83: (8, lambda raw: struct.unpack(">q", raw)[0] / 1000),
    0x84: (8, bytes),
    0x94: (16, bytes),
    0x98: (16, lambda raw: uuid.UUID(bytes=raw)),
}
"""Fixed-width codes: (width, how the bytes read). 0x83, a timestamp, reads as seconds."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """A body section of another type than binary or string, not read: it is kept encoded."""

    kind: str


_KINDS = {0x45: "list", 0xC0: "list", 0xD0: "list", 0xC1: "map", 0xD1: "map"}
_KINDS.update({0xE0: "array", 0xF0: "array", 0x00: "described"})
_EMPTY: dict[int, Any] = {0x40: None, 0x41: True, 0x42: False, 0x43: 0, 0x44: 0, 0x45: []}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise Unknown("the message ends in the middle of a value")
        value = self.data[self.at]
        self.at += 1
        return value

    def take(self, count: int) -> bytes:
        end = self.at + count
        if end > len(self.data):
            raise Unknown("the message ends in the middle of a value")
        raw = self.data[self.at : end]
        self.at = end
        return raw

    def value(self) -> Any:
        data, at = self.data, self.at
        if at >= len(data):
            raise Unknown("the message ends in the middle of a value")
        code = data[at]
        if code == 0xA1 or code == 0xA3:  # str8 and sym8, most of what a message holds
            end = at + 2 + data[at + 1] if at + 1 < len(data) else len(data) + 1
            if end > len(data):
                raise Unknown("the message ends in the middle of a value")
            self.at = end
            text = (
                data[at + 2 : end].decode() if code == 0xA1 else data[at + 2 : end].decode("ascii")
            )
            return text if code == 0xA1 else Symbol(text)
        if code == 0x40:
            self.at = at + 1
            return None
        self.at = at + 1
        if code == 0x00:
            descriptor = self.value()
            return Described(descriptor, self.value())
        return self.of(code)

    def of(self, code: int) -> Any:
        if code in _EMPTY:
            empty = _EMPTY[code]
            return [] if code == 0x45 else empty
        fixed = _FIXED.get(code)
        if fixed is not None:
            width, read = fixed
            return read(self.take(width))
        wide = code >> 4 in (0xB, 0xD, 0xF)
        if code & 0xF0 in (0xA0, 0xB0):
            raw = self.take(self._size(wide))
            if code in (0xA0, 0xB0):
                return raw
            if code in (0xA1, 0xB1):
                return raw.decode()
            if code in (0xA3, 0xB3):
                return Symbol(raw.decode("ascii"))
        elif code in (0xC0, 0xD0, 0xC1, 0xD1):
            self._size(wide)
            count = self._size(wide)
            items = [self.value() for _ in range(count)]
            if code in (0xC0, 0xD0):
                return items
            return dict(zip(items[::2], items[1::2], strict=True))
        elif code in (0xE0, 0xF0):
            self._size(wide)
            count = self._size(wide)
            element = self.byte()
            if element == 0x00:
                raise Unknown("an array of described values")
            if count > len(self.data) - self.at:  # elements of no width (nulls) cost no bytes
                raise Unknown(f"an array of {count} elements in fewer bytes")
            return [self.of(element) for _ in range(count)]
        raise Unknown(f"byte {self.at - 1}: unknown type code 0x{code:02x}")

    def body(self) -> Any:
        """A body section's value if it is binary or a string; else skipped by its size (None).

        A body of another type is kept encoded, not read: a large list would hold the loop.
        """
        code = self.data[self.at] if self.at < len(self.data) else None
        if code in (0xA0, 0xB0, 0xA1, 0xB1):
            return self.value()
        self.skip()
        return Skipped(_KINDS.get(code, "value") if code is not None else "value")

    def skip(self) -> None:
        """Step over one value by its encoded size, building nothing."""
        code = self.byte()
        if code == 0x00:
            self.skip()
            self.skip()
        elif code in _EMPTY:
            pass
        elif code in _FIXED:
            self.take(_FIXED[code][0])
        elif code >> 4 in (0xA, 0xB, 0xC, 0xD, 0xE, 0xF):
            self.take(self._size(code >> 4 in (0xB, 0xD, 0xF)))
        else:
            raise Unknown(f"byte {self.at - 1}: unknown type code 0x{code:02x}")

    def _size(self, wide: bool) -> int:
        return int(struct.unpack(">I", self.take(4))[0]) if wide else self.byte()
