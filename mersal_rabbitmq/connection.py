"""The connection to RabbitMQ, its channels, and the one registry of what it restores.

aio-pika's robust connection reconnects by itself, but the plain channels used here (not
aio-pika's robust ones) die with the old connection. Whatever must come back registers a
restore callback with the connection: the topology (every exchange, queue and binding
declared) and each consumer (its channel, its queue, its subscription). After every reconnect
each registered callback runs again, once connected, the way aio-pika's robust objects restore
themselves. An object that lost its channel while the connection stayed up (a channel error,
or the broker cancelling a consumer whose queue was deleted) asks its own registration for a
restore: the same callback, the same bounded retries, then the object hears that it is lost.
Publishing channels register nothing: a closed one is replaced when it is next needed.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aio_pika.connection import make_url

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.transport import mask

log = logging.getLogger("mersal.rabbitmq")

RECONNECT_INTERVAL = 1.0
"""Seconds between reconnection attempts unless the URL's `reconnect_interval` says otherwise."""
CHANNEL_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
"""What a channel raises when it, or its connection, closed under the caller."""

Restore = Callable[[], Awaitable[None]]
"""Brings one object back on the current connection; raises if it cannot."""
Lost = Callable[[Exception, int], None]
"""Hears that a restore failed for good: the last error and the number of attempts."""


class Connection:
    """One robust connection to RabbitMQ, plain channels on it, and what it restores."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.current: AbstractRobustConnection | None = None
        """The aio-pika connection while open, else None."""
        self._registrations: dict[Registration, None] = {}  # a dict keeps registration order
        self._closed = asyncio.Event()  # wakes whoever waits for a reconnect, at close()

    def require(self) -> AbstractRobustConnection:
        """The aio-pika connection; raises while not open."""
        if self.current is None:
            raise MersalError(
                f"the RabbitMQ transport for {mask(self.address)} is not running (never "
                "started, or stopped): nothing was sent or declared; `await transport.start()` "
                "first"
            )
        return self.current

    @property
    def connected(self) -> bool:
        """Whether the connection to RabbitMQ is up right now."""
        connection = self.current
        if connection is None or not connection.connected.is_set():
            return False
        transport = connection.transport
        return transport is not None and not transport.connection.is_closed

    async def open(self, heartbeat: int | None) -> AbstractRobustConnection:
        """Connect; from now on, every reconnect runs the registered restores."""
        options: dict[str, Any] = {}
        if "reconnect_interval" not in parse_qs(urlsplit(self.address).query):
            options["reconnect_interval"] = RECONNECT_INTERVAL
        if heartbeat is not None:
            options["heartbeat"] = heartbeat
        try:
            connection = await _connect(self.address, options)
        except ValueError as error:
            raise ConfigurationError(
                f"{mask(self.address)} is not a usable AMQP URL ({error}): "
                "use amqp://user:password@host:port/vhost"
            ) from None
        except (OSError, aiormq.exceptions.AMQPError) as error:
            raise connect_failure(self.address, error) from None
        connection.reconnect_callbacks.add(self._on_reconnect)
        self.current = connection
        self._closed = asyncio.Event()
        return connection

    async def close(self) -> None:
        """Restore nothing more, and disconnect."""
        connection, self.current = self.current, None
        self._closed.set()
        for registration in list(self._registrations):
            await registration.cancel()
        if connection is not None:
            await connection.close()

    async def ready(self) -> None:
        """Wait until the connection is up (it reconnects by itself); raises once closed."""
        connection = self.require()
        if self.connected:
            return
        reconnected = asyncio.ensure_future(connection.ready())
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((reconnected, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reconnected.cancel()
            closed.cancel()
        if not reconnected.done() or reconnected.cancelled():
            self.require()  # closed meanwhile: says so
        reconnected.result()

    async def channel(self, *, confirms: bool = False) -> AbstractChannel:
        """A new plain channel (restored by whoever registered it), once connected."""
        await self.ready()
        connection = self.require()
        channel = aio_pika.Channel(
            connection, publisher_confirms=confirms, on_return_raises=confirms
        )
        try:
            await channel.initialize()
        except BaseException as error:
            lost = closed_under(error, not self.connected, "the connection closed under it")
            if lost is None:
                raise
            raise lost from error
        return channel

    def register(
        self, what: str, restore: Restore, *, delays: Sequence[float] = (), lost: Lost | None = None
    ) -> Registration:
        """Run `restore` after every reconnect, and whenever the registration is asked to.

        `what` names it in the logs ("consuming 'orders'"). While connected, a failed restore
        is tried again after each of `delays`; then `lost` hears of it and the registration ends.
        """
        registration = Registration(self, self._registrations, what, restore, delays, lost)
        self._registrations[registration] = None
        return registration

    def _on_reconnect(self, connection: object) -> None:
        log.info(
            "reconnected to RabbitMQ at %s; declaring the topology again and consuming again",
            mask(self.address),
        )
        for registration in list(self._registrations):
            registration.restore()


class Registration:
    """One restore callback of a connection's registry."""

    def __init__(
        self,
        connection: Connection,
        registry: dict[Registration, None],
        what: str,
        restore: Restore,
        delays: Sequence[float],
        lost: Lost | None,
    ) -> None:
        self.what = what
        self._connection = connection
        self._registry = registry
        self._restore = restore
        self._delays = delays
        self._lost = lost
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def restore(self) -> None:
        """Restore in the background, once connected; once more after a restore under way."""
        if self not in self._registry:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"mersal-rabbitmq {self.what}")
        else:
            self._again = True

    async def cancel(self) -> None:
        """Restore no more; stop a restore under way."""
        self._registry.pop(self, None)
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._again = False
            if not await self._attempts() or not self._again:
                return

    async def _attempts(self) -> bool:
        """Restore, trying again while connected; False once it gave up."""
        failures = 0
        while True:
            await self._connection.ready()
            try:
                await self._restore()
            except Exception as error:
                if not self._connection.connected:  # not this object's fault: wait for it
                    await asyncio.sleep(0.1)
                    continue
                if failures == len(self._delays):
                    self._give_up(error, failures + 1)
                    return False
                log.warning(
                    "%s again failed (%s: %s); retrying in %gs",
                    self.what,
                    type(error).__name__,
                    error,
                    self._delays[failures],
                )
                await asyncio.sleep(self._delays[failures])
                failures += 1
            else:
                return True

    def _give_up(self, error: Exception, attempts: int) -> None:
        self._registry.pop(self, None)
        if self._lost is not None:
            self._lost(error, attempts)
        else:
            log.error("%s again failed: %s: %s", self.what, type(error).__name__, error)


async def close_quietly(channel: AbstractChannel) -> None:
    """Close a channel that is going away either way; a failure is only logged."""
    try:
        await channel.close()
    except Exception as error:
        log.debug("closing a channel failed: %s", error)


async def _connect(address: str, options: dict[str, Any]) -> AbstractRobustConnection:
    """`aio_pika.connect_robust`, except that a failed first connect leaves no reconnect loop."""
    connection = aio_pika.RobustConnection(make_url(address, **options), **options)
    try:
        await connection.connect()
    except BaseException:
        await connection.close()
        raise
    return connection


def connect_failure(address: str, error: Exception) -> MersalError:
    """The error for a failed connect: `Unreachable` when nothing answered, else what refused."""
    user, vhost = _login_of(address)
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return ConfigurationError(
            f"RabbitMQ at {mask(address)} refused the login for user {user!r}: check the user "
            "name and password"
        )
    if isinstance(error, aiormq.exceptions.InvalidFrameError) and "Connection.OpenOk" in str(
        error
    ):  # RabbitMQ answered Connection.Open with Connection.Close: the vhost is the trouble
        return ConfigurationError(
            f"RabbitMQ at {mask(address)} refused to open the vhost: vhost {vhost!r} does not "
            f"exist or user {user!r} may not use it; fix the vhost in the URL, or create it and "
            f"let the user in (rabbitmqctl add_vhost {vhost}; rabbitmqctl set_permissions -p "
            f"{vhost} {user} '.*' '.*' '.*')"
        )
    if isinstance(error, ssl.SSLError) or isinstance(error.__cause__, ssl.SSLError):
        return ConfigurationError(
            f"the TLS handshake with RabbitMQ at {mask(address)} failed "
            f"({type(error).__name__}: {error}): check the port (5671 for amqps), the server's "
            "certificate and the CA the client trusts (?cafile=... in the URL)"
        )
    if isinstance(error, OSError | TimeoutError) or isinstance(error.__cause__, OSError):
        return Unreachable(
            f"cannot connect to RabbitMQ at {mask(address)}: {type(error).__name__}: {error}; "
            "is it running, and are the host and port right?"
        )
    return MersalError(
        f"cannot connect to RabbitMQ at {mask(address)}: {type(error).__name__}: {error}; "
        "check the URL, the vhost and the credentials"
    )


def _login_of(address: str) -> tuple[str, str]:
    """The user name and vhost an AMQP URL logs in with (aio-pika's defaults: guest, /)."""
    url = make_url(address)
    return url.user or "guest", url.path[1:].replace("%2F", "/") or "/"


def closed_under(error: BaseException, closed: bool, what: str) -> ConnectionError | None:
    """`error` as a lost connection, if aiormq raised it for a close mid-call; else None.

    A closing connection fails what is pending on it with a RuntimeError or a bare Exception
    (`closed` tells those from other errors), or, when aio-pika closes it (at app.stop()),
    with a CancelledError in a task that nobody cancelled.
    """
    if isinstance(error, CHANNEL_ERRORS):
        return None
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return None
    elif not (closed and isinstance(error, Exception)):
        return None
    return ConnectionError(f"{what} ({why(error)})")


def why(error: BaseException | None) -> str:
    """An error for a message or a log line: its type and text, or that none was given."""
    if error is None:
        return "no reason given"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__}, no reason given"
