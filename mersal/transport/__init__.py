"""The Transport protocol every broker adapter implements, and transports by URL."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mersal.errors import ConfigurationError
from mersal.messages import Envelope, Header


@dataclass(slots=True)
class Outgoing:
    """One message on its way out: the queue it is sent to, or the topic it is published on."""

    address: str
    envelope: Envelope
    publish: bool = False

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


@runtime_checkable
class Transport(Protocol):
    """Moves envelopes between queues; a broker adapter implements this."""

    address: str

    async def start(self) -> None:
        """Connect."""
        ...

    async def stop(self) -> None:
        """Disconnect; unacknowledged deliveries return to their queues."""
        ...

    async def declare(self, queue: str, *, temporary: bool = False) -> None:
        """Make sure `queue` exists (a temporary one goes away when the transport stops)."""
        ...

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        ...

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Hand all messages to the broker, in order; returns once the broker holds them."""
        ...

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Start receiving from `queue`."""
        ...


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


def transport_from(value: str | Transport | None) -> Transport:
    """The transport for a URL (`memory://`, `amqp://…`), an object, or `MERSAL_TRANSPORT`."""
    if value is None:
        value = os.environ.get("MERSAL_TRANSPORT") or "memory://"
    if not isinstance(value, str):
        return value
    scheme = value.partition("://")[0].lower()
    if scheme == "memory":
        from mersal.transport.memory import MemoryTransport

        return MemoryTransport(value)
    if scheme in ("amqp", "amqps"):
        try:
            from mersal_rabbitmq import RabbitMQTransport
        except ImportError as error:
            raise ConfigurationError(
                f"transport {mask(value)} needs the RabbitMQ adapter: "
                f"pip install 'mersal[rabbitmq]' ({error})"
            ) from None
        transport: Transport = RabbitMQTransport(value)
        return transport
    raise ConfigurationError(
        f"unknown transport {mask(value)!r}: use 'memory://', 'amqp://user:pass@host/vhost' "
        "or pass a Transport object"
    )


# A query parameter carrying a password (asyncpg reads `password` and `sslpassword` there).
_QUERY_PASSWORD = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


def mask(url: str) -> str:
    """The URL with any password (user info or query) replaced by `***`, fit for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    credentials, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}{sep}{user}{':***' if colon else ''}@{host}"
    return _QUERY_PASSWORD.sub(r"\1***", url)
