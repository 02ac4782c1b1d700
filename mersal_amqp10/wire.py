"""Envelopes as AMQP 1.0 messages: headers as application properties, the body as one data section.

Every header travels as an application property (a string), and the well-known ones are
mirrored to the standard properties (`message-id`, `correlation-id`, `reply-to`,
`content-type`, `subject` for the type, `creation-time` for the sent-at time), which producers
in other languages read and write. On receipt the application properties come first and the
standard properties fill what they lack.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import proton

from mersal.messages import Envelope, Header
from mersal_rabbitmq.wire import header_text

UNREADABLE = "application/x-amqp-value"
"""The content type given to a body that is not bytes or a string (the decode step refuses it)."""

_MIRRORED = (
    ("id", Header.MESSAGE_ID),
    ("correlation_id", Header.CORRELATION_ID),
    ("reply_to", Header.REPLY_TO),
    ("content_type", Header.CONTENT_TYPE),
    ("subject", Header.TYPE),
)
"""(proton.Message attribute, Mersal header) pairs: the headers mirrored to standard properties."""


@dataclass(slots=True)
class Received:
    """A message as read off a receiver link."""

    envelope: Envelope
    redelivered: bool


def encode(envelope: Envelope) -> bytes:
    """The AMQP 1.0 message for `envelope`: durable, its headers, its body in a data section."""
    headers = envelope.headers
    message = proton.Message(
        body=envelope.body, inferred=True, durable=True, properties=dict(headers)
    )
    for attribute, header in _MIRRORED:
        value = headers.get(header)
        if value:
            setattr(message, attribute, value)
    sent_at = _seconds(headers.get(Header.SENT_AT))
    if sent_at is not None:
        message.creation_time = sent_at
    return message.encode()


def decode(encoded: bytes) -> Received:
    """Our envelope for a received message, and whether the broker delivered it before.

    A body that is not bytes or a string (an AMQP value of another type, or several sections)
    is kept AMQP-encoded, with a content type that says so, for the decode step to refuse.
    """
    message = proton.Message()
    message.decode(encoded)
    headers: dict[str, str] = {}
    properties: dict[object, object] = message.properties or {}
    for key, value in properties.items():
        text = _text(value)
        if text is not None and isinstance(key, str):
            headers[key] = text
    for attribute, header in _MIRRORED:
        value = getattr(message, attribute, None)
        if isinstance(value, proton.symbol) and value == "None":
            continue  # proton's content_type when the message has none
        if value and header not in headers:
            text = _text(value)
            if text is not None:
                headers[header] = text
    if Header.SENT_AT not in headers and message.creation_time:
        headers[Header.SENT_AT] = f"{message.creation_time:.6f}"
    body = message.body
    if isinstance(body, str):
        body = body.encode()
    elif isinstance(body, bytes | bytearray | memoryview):
        body = bytes(body)
    else:
        body = _amqp_encoded(body)
        headers[Header.CONTENT_TYPE] = f"{UNREADABLE}; type={type(message.body).__name__}"
    redelivered = not message.first_acquirer or message.delivery_count > 0
    return Received(Envelope(headers, body), redelivered)


def _amqp_encoded(value: object) -> bytes:
    data = proton.Data()
    try:
        data.put_object(value)
    except Exception:  # a value proton read but cannot write back: keep what it shows
        return repr(value).encode()
    return data.encode()


def _text(value: object) -> str | None:
    """A property as a string (a UUID as its canonical form); None for lists and maps."""
    return str(value) if isinstance(value, uuid.UUID) else header_text(value)


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 < seconds < 253402300800 else None
