"""Envelopes on the wire: AMQP properties and headers to and from Mersal's headers, and limits.

The well-known headers travel as AMQP properties (which producers in other languages read and
write); every other header, and any well-known one too long for a property, as an AMQP header.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection
from aiormq.abc import DeliveredMessage

from mersal.messages import Envelope, Header
from mersal.transport.limits import Limits
from mersal_rabbitmq.delays import MAX_WAIT_MS

PERSISTENT = int(aio_pika.DeliveryMode.PERSISTENT)
DEFAULT_FRAME_MAX = 131_072  # RabbitMQ's default frame_max
FRAME_SLACK = 4_096  # room for the properties and the frame's own fields
SHORT_STRING = 255  # bytes in an AMQP short string (message_id, type, reply_to, ...)

PROPERTY_HEADERS = (
    ("message_id", Header.MESSAGE_ID),
    ("correlation_id", Header.CORRELATION_ID),
    ("message_type", Header.TYPE),
    ("reply_to", Header.REPLY_TO),
    ("content_type", Header.CONTENT_TYPE),
)
"""(AMQP property, Mersal header) pairs: the headers that travel as properties."""
IN_PROPERTIES = frozenset(header for _, header in PROPERTY_HEADERS)
"""Headers carried by AMQP properties alone (the receiver restores them from there)."""
BROKER_HEADERS = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")
"""Prefixes of the headers RabbitMQ adds (dead-lettering, quorum redelivery); dropped on receive."""


def amqp_properties(envelope: Envelope) -> aiormq.spec.Basic.Properties:
    """The AMQP properties: the well-known headers as properties, the others as AMQP headers."""
    headers = envelope.headers
    amqp_headers: dict[str, Any] = {
        key: value
        for key, value in headers.items()
        if key not in IN_PROPERTIES or len(value.encode()) > SHORT_STRING
    }
    return aiormq.spec.Basic.Properties(
        headers=amqp_headers,
        message_id=_short(headers.get(Header.MESSAGE_ID)),
        correlation_id=_short(headers.get(Header.CORRELATION_ID)),
        message_type=_short(headers.get(Header.TYPE)),
        reply_to=_short(headers.get(Header.REPLY_TO)),
        content_type=_short(headers.get(Header.CONTENT_TYPE)),
        timestamp=_timestamp(headers.get(Header.SENT_AT)),
        delivery_mode=PERSISTENT,
    )


def envelope_of(message: DeliveredMessage) -> Envelope:
    """Our envelope for a received message: its headers, else its properties; then its body."""
    properties = message.header.properties
    headers: dict[str, str] = {}
    for key, value in (properties.headers or {}).items():
        text = header_text(value)
        if text is not None and not key.startswith(BROKER_HEADERS):
            headers[key] = text
    for name, header in PROPERTY_HEADERS:
        value = getattr(properties, name, None)
        if value and header not in headers:
            headers[header] = str(value)
    timestamp = properties.timestamp
    if Header.SENT_AT not in headers and isinstance(timestamp, datetime):
        headers[Header.SENT_AT] = f"{timestamp.timestamp():.6f}"
    return Envelope(headers, message.body)


def redelivered(message: DeliveredMessage) -> bool:
    """Whether the broker delivered the message before (a quorum queue counts deliveries)."""
    count = (message.header.properties.headers or {}).get("x-delivery-count")
    return bool(message.redelivered) or (isinstance(count, int) and count > 0)


def header_text(value: object) -> str | None:
    """A header value as a string; None for values that are not scalars (lists, tables)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, datetime):
        return f"{value.timestamp():.6f}"
    return None


def limits_for(connection: AbstractConnection) -> Limits:
    """What this broker connection carries: headers within one frame of the size agreed on."""
    underlay = getattr(connection, "transport", None)
    tune = getattr(getattr(underlay, "connection", None), "connection_tune", None)
    frame_max = getattr(tune, "frame_max", 0) or DEFAULT_FRAME_MAX
    return Limits(max_header_bytes=frame_max - FRAME_SLACK, max_delay=MAX_WAIT_MS / 1000)


def broker_version(connection: AbstractConnection | None) -> str:
    """The RabbitMQ version the broker announced on connecting ('' if unknown)."""
    underlay = getattr(connection, "transport", None)
    properties = getattr(getattr(underlay, "connection", None), "server_properties", None)
    version = properties.get("version") if isinstance(properties, dict) else None
    if isinstance(version, bytes):
        version = version.decode("utf-8", "replace")
    return version if isinstance(version, str) else ""


def _short(value: str | None) -> str | None:
    """The value if it fits an AMQP short string (properties); headers carry it regardless."""
    return value if value and len(value.encode()) <= SHORT_STRING else None


def _timestamp(value: str | None) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(value), tz=UTC) if value else None
    except (ValueError, OverflowError, OSError):
        return None
