"""Workarounds for known defects of the AMQP libraries underneath, for Mersal's connections only.

Each one turns a single hostile or refused message, which the libraries let break a whole
connection again and again, back into one message's trouble. None changes what the libraries
do for other code in the same process (a user's own aio-pika connections): the channel guard
is a subclass given to Mersal's channels alone, and the lenient reading and the quieter log
act only in the context that Mersal's connections and restored channels are opened in
(`own_context`), which their reader tasks and close callbacks inherit. Remove one when the
library it works around is fixed.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiormq.abc
import aiormq.channel
import pamqp.decode
from aio_pika.abc import AbstractChannel
from aiormq.exceptions import ChannelInvalidStateError

APPLIED = "mersal_patched"
TIMESTAMP_BYTES = 8  # an AMQP timestamp: seconds since 1970, unsigned 64 bits
OWN = contextvars.ContextVar("mersal_rabbitmq_own_connection", default=False)
"""True in the tasks of Mersal's connections (their attempts and readers), else False."""
CLIENT_LOG = "aiormq.connection"
"""aiormq's logger, which says ERROR for every failed TCP connect and every broker's close."""
CALLBACK_LOG = "aio_pika.tools"
"""aio-pika's logger for a callback that raised: a robust channel's failed restore of itself."""


def own_context() -> contextvars.Context:
    """A context to open one of Mersal's connections in; installs the workarounds (once)."""
    read_leniently()
    keep_lost_connections_to_mersals_line()
    context = contextvars.copy_context()
    context.run(OWN.set, True)
    return context


def read_leniently() -> None:
    """On Mersal's connections, read what a producer wrote that pamqp cannot: short strings and
    header names that are not UTF-8 (U+FFFD in place of the bad bytes), and timestamps that no
    datetime holds (past the year 9999: read as None).

    RabbitMQ passes such bytes on from a producer. pamqp raises while reading the frame,
    inside aiormq, before Mersal sees the message: the connection drops, and the broker
    delivers the message again, forever. Read leniently, the message reaches the app, which
    handles it or dead-letters it like any other. pamqp's functions are looked up by name in
    its `METHODS` (and a table's values by type in `TABLE_MAPPING`); the ones put there call
    pamqp's own, unchanged, outside Mersal's context.
    """
    methods, mapping = pamqp.decode.METHODS, pamqp.decode.TABLE_MAPPING
    if getattr(methods.get("table"), APPLIED, False):
        return
    strict_short, strict_table = methods["shortstr"], methods["table"]
    strict_timestamp = methods["timestamp"]

    def short_str(value: bytes) -> tuple[int, Any]:
        if not OWN.get():
            return strict_short(value)
        try:
            return strict_short(value)
        except UnicodeDecodeError:
            length = value[0]
            return length + 1, value[1 : length + 1].decode("utf-8", "replace")

    def field_table(value: bytes) -> tuple[int, Any]:
        if not OWN.get():
            return strict_table(value)
        try:
            return strict_table(value)
        except UnicodeDecodeError:
            return lenient_table(value)

    def timestamp(value: bytes) -> tuple[int, Any]:
        if not OWN.get() or len(value) < TIMESTAMP_BYTES:
            return strict_timestamp(value)
        try:
            return strict_timestamp(value)
        except (ValueError, OverflowError, OSError):  # no datetime for it
            return TIMESTAMP_BYTES, None

    setattr(field_table, APPLIED, True)
    methods["shortstr"] = short_str
    methods["table"] = mapping[b"F"] = field_table
    methods["timestamp"] = mapping[b"T"] = timestamp


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


def keep_lost_connections_to_mersals_line() -> None:
    """Drop the libraries' lines for a failed connect or a lost connection of Mersal's own.

    The connection logs one WARNING per lost connection (with the broker's reason) and one
    line per round of reconnect attempts, naming each node's reason; aiormq's ERROR for every
    failed attempt (one a second, with every node down), its ERROR for the broker's close and
    its WARNING with a traceback for the socket's end say nothing more. Nor does aio-pika's
    ERROR for a robust channel that tried to restore itself and failed (on a lost connection it
    always does): its consumer restores it, and says so if it cannot. A reader that ended on
    anything but a lost connection (a malformed frame) keeps its line, and so do other code's
    connections and channels.
    """
    for name in (CLIENT_LOG, CALLBACK_LOG):
        client = logging.getLogger(name)
        if not any(isinstance(each, _OwnConnectionNoise) for each in client.filters):
            client.addFilter(_OwnConnectionNoise())


NOISE = ("error when creating transport", "Unexpected connection close from remote")
"""How the lines of aiormq that Mersal's own say again begin."""
READER_ENDED = "Cancelling cause reader exited abnormally"
SELF_RESTORE = "RobustChannel._on_close"
"""The callback a robust channel restores itself in, as aio-pika names it in its line."""


class _OwnConnectionNoise(logging.Filter):
    """Lets through every record but the libraries' connect and close lines in Mersal's context."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not OWN.get():
            return True
        text = str(record.msg)
        if text.startswith(NOISE):
            return False
        if text.startswith(READER_ENDED) and record.exc_info:
            return not isinstance(record.exc_info[1], ConnectionError)
        if record.name == CALLBACK_LOG and isinstance(record.args, tuple) and record.args:
            return SELF_RESTORE not in repr(record.args[0])
        return True


async def guard(channel: AbstractChannel) -> None:
    """Make one of Mersal's channels fail a publish that waited for it after the broker closed it.

    aiormq 7 answers the broker's Channel.Close before it marks the channel closed; a publish
    waiting for the channel's lock then writes on it, and RabbitMQ closes the whole connection
    (504 CHANNEL_ERROR), consumers included. On a guarded channel the publish fails as "channel
    gone" without a word reaching the broker, and is sent again.
    """
    guard_underlay(await channel.get_underlay_channel())


def guard_underlay(underlay: aiormq.abc.AbstractChannel) -> None:
    """Guard one of aiormq's channels (see `guard`), unless it is of another class already."""
    if type(underlay) is aiormq.channel.Channel:
        underlay.__class__ = GuardedChannel


class GuardedChannel(aiormq.channel.Channel):
    """aiormq's channel whose lock refuses a channel the broker closed."""

    @property
    def lock(self) -> Any:
        """The channel's lock, refusing once the broker closed the channel."""
        return _refusing_closed(self, aiormq.channel.Channel.lock.fget(self))  # type: ignore[attr-defined]


@asynccontextmanager
async def _refusing_closed(channel: aiormq.channel.Channel, lock: Any) -> AsyncIterator[None]:
    async with lock:
        if getattr(channel, "_close_exception", None) is not None:
            raise ChannelInvalidStateError(f"{channel!r} was closed by the broker")
        yield
