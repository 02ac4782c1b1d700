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
from typing import Any

from mersal.messages import Envelope, Header
from mersal_amqp10 import encoding
from mersal_rabbitmq.wire import header_text

UNREADABLE = "application/x-amqp-value"
"""The content type given to a body that is not bytes or a string (the decode step refuses it)."""

_MIRRORED = (
    (0, Header.MESSAGE_ID),
    (3, Header.TYPE),
    (4, Header.REPLY_TO),
    (5, Header.CORRELATION_ID),
    (6, Header.CONTENT_TYPE),
)
"""(field of the properties section, Mersal header): the headers mirrored to standard properties."""
CREATION_TIME = 9
"""The properties section's creation-time field."""
FIRST_ACQUIRER, DELIVERY_COUNT = 3, 4
"""The header section's fields that tell a redelivery."""


@dataclass(slots=True)
class Received:
    """A message as read off a receiver link."""

    envelope: Envelope
    redelivered: bool


def encode(envelope: Envelope) -> bytes:
    """The AMQP 1.0 message for `envelope`: durable, its headers, its body in a data section."""
    headers = envelope.headers
    return encoding.message(
        headers,
        message_id=headers.get(Header.MESSAGE_ID) or None,
        subject=headers.get(Header.TYPE) or None,
        reply_to=headers.get(Header.REPLY_TO) or None,
        correlation_id=headers.get(Header.CORRELATION_ID) or None,
        content_type=headers.get(Header.CONTENT_TYPE) or None,
        creation_time=_seconds(headers.get(Header.SENT_AT)),
        body=envelope.body,
    )


def decode(encoded: bytes) -> Received:
    """Our envelope for a received message, and whether the broker delivered it before.

    A body that is not bytes or a string (an AMQP value of another type, a sequence, several
    sections) is kept AMQP-encoded, with a content type that says so, for the decode step to
    refuse.
    """
    found = encoding.sections(encoded)
    headers: dict[str, str] = {}
    for key, value in found.application_properties.items():
        text = _text(value)
        if text is not None and isinstance(key, str):
            headers[key] = text
    properties = found.properties
    for index, header in _MIRRORED:
        value = properties[index] if index < len(properties) else None
        if value and header not in headers:
            text = _text(value)
            if text is not None:
                headers[header] = text
    created = _field(properties, CREATION_TIME)
    if Header.SENT_AT not in headers and isinstance(created, int | float) and created:
        headers[Header.SENT_AT] = f"{created:.6f}"
    body = found.body
    if found.body_span == (0, 0):  # no body section: an empty body
        body = b""
    elif isinstance(body, str):
        body = body.encode()
    elif isinstance(body, bytes | bytearray | memoryview) and found.body_raw is None:
        body = bytes(body)
    else:
        kind = body.kind if isinstance(body, encoding.Skipped) else type(body).__name__
        kind = "sections" if found.body_raw is not None else kind
        body = found.encoded_body()
        headers[Header.CONTENT_TYPE] = f"{UNREADABLE}; type={kind}"
    fields = found.header
    redelivered = _field(fields, FIRST_ACQUIRER) is False or bool(_field(fields, DELIVERY_COUNT))
    return Received(Envelope(headers, body), redelivered)


def _field(fields: list[Any], index: int) -> Any:
    return fields[index] if index < len(fields) else None


def _text(value: object) -> str | None:
    """A property as a string (a UUID as its canonical form); None for lists and maps."""
    return str(value) if isinstance(value, uuid.UUID) else header_text(value)


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 < seconds < 253402300800 else None
