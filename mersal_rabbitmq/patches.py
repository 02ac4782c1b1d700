"""Workarounds for known defects of the AMQP libraries underneath, applied once on import.

Each one turns a single hostile or refused message, which the libraries let break a whole
connection again and again, back into one message's trouble. Remove one when the library
it works around is fixed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiormq.channel
import pamqp.decode
from aiormq.exceptions import ChannelInvalidStateError

APPLIED = "mersal_patched"


def apply() -> None:
    """Apply every workaround (once)."""
    tolerate_text_that_is_not_utf8()
    refuse_writes_on_channels_the_broker_closed()


def tolerate_text_that_is_not_utf8() -> None:
    """Read AMQP short strings and header names that are not UTF-8 with U+FFFD in their place.

    RabbitMQ passes such bytes on from a producer. pamqp raises while reading the frame,
    inside aiormq, before Mersal sees the message: the connection drops, and the broker
    delivers the message again, forever. Read leniently, the message reaches the app, which
    handles it or dead-letters it like any other.
    """
    methods, mapping = pamqp.decode.METHODS, pamqp.decode.TABLE_MAPPING
    if getattr(methods.get("table"), APPLIED, False):
        return
    strict_short, strict_table = methods["shortstr"], methods["table"]

    def short_str(value: bytes) -> tuple[int, Any]:
        try:
            return strict_short(value)
        except UnicodeDecodeError:
            length = value[0]
            return length + 1, value[1 : length + 1].decode("utf-8", "replace")

    def field_table(value: bytes) -> tuple[int, Any]:
        try:
            return strict_table(value)
        except UnicodeDecodeError:
            return lenient_table(value)

    setattr(field_table, APPLIED, True)
    methods["shortstr"] = short_str
    methods["table"] = mapping[b"F"] = field_table


def lenient_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """An AMQP field table (a 4-byte size, then short-string names and typed values)."""
    end = 4 + int.from_bytes(value[:4], "big")
    table: dict[str, Any] = {}
    offset = 4
    while offset < end:
        size = value[offset]
        name = value[offset + 1 : offset + 1 + size].decode("utf-8", "replace")
        offset += 1 + size
        consumed, table[name] = pamqp.decode.embedded_value(value[offset:end])
        offset += consumed
    return end, table


def refuse_writes_on_channels_the_broker_closed() -> None:
    """Fail a publish that waited for a channel the broker has closed meanwhile, unwritten.

    aiormq 7 answers the broker's Channel.Close before it marks the channel closed; a publish
    waiting for the channel's lock then writes on it, and RabbitMQ closes the whole connection
    (504 CHANNEL_ERROR), consumers included. With this, the publish fails as "channel gone"
    without a word reaching the broker, and is sent again.
    """
    channel = aiormq.channel.Channel
    original: property = channel.__dict__["lock"]
    if isinstance(original, _GuardedLock):
        return
    acquire = original.fget
    assert acquire is not None

    @asynccontextmanager
    async def guarded(self: aiormq.channel.Channel) -> AsyncIterator[None]:
        async with acquire(self):
            if self._close_exception is not None:
                raise ChannelInvalidStateError(f"{self!r} was closed by the broker")
            yield

    setattr(channel, "lock", _GuardedLock(guarded))  # noqa: B010 - replaced on the class


class _GuardedLock(property):
    """The channel lock, refusing channels the broker closed (marks the patch as applied)."""
