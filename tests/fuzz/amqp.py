"""Reading a raw AMQP message the way the wire contract says a Mersal app reads it."""

from __future__ import annotations

from typing import Any

from aio_pika.abc import AbstractIncomingMessage

# AMQP properties that stand for a header when the header itself is absent.
PROPERTIES = (
    ("type", "type"),
    ("message_id", "message-id"),
    ("correlation_id", "correlation-id"),
    ("reply_to", "reply-to"),
    ("content_type", "content-type"),
)


def headers_of(message: AbstractIncomingMessage) -> dict[str, Any]:
    """The message's headers, completed from its well-known properties."""
    headers: dict[str, Any] = dict(message.headers or {})
    for name, header in PROPERTIES:
        value = getattr(message, name, None)
        if value and header not in headers:
            headers[header] = value
    return headers
