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

Failover: the address may list several nodes of a cluster, full URLs separated by `;` (as
kombu takes them). The first that answers is used; when its connection is lost, or a
reconnect attempt fails, the next one in the list is tried, round the list, and the restores
run on whichever node answered. Logs name the node.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aio_pika.connection import make_url

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.transport import mask, split_urls
from mersal_rabbitmq.urls import node_urls

log = logging.getLogger("mersal.rabbitmq")

RECONNECT_INTERVAL = 1.0
"""Seconds between reconnection attempts unless the URL's `reconnect_interval` says otherwise."""
CONNECT_TIMEOUT = 10.0
"""Seconds one attempt to connect to a node may take (a node can take the TCP connection and
never answer): then the next node is tried."""
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
        self.nodes = nodes_of(address)
        """The URLs of the nodes to try, in order: one, or several for failover."""
        self.current: Failover | None = None
        """The aio-pika connection while open, else None."""
        self._registrations: dict[Registration, None] = {}  # a dict keeps registration order
        self._closed = asyncio.Event()  # wakes whoever waits for a reconnect, at close()

    @property
    def node(self) -> str:
        """The URL (password masked) of the node connected to, or to be tried next."""
        connection = self.current
        return connection.node if connection is not None else mask(self.nodes[0])

    def require(self) -> Failover:
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
        """Connect to the first node that answers; from now on, every reconnect restores."""
        failures: list[MersalError] = []
        for first in range(len(self.nodes)):
            try:
                connection = await _connect(self.nodes, first, _options(self.nodes[0], heartbeat))
            except ValueError as error:
                raise ConfigurationError(
                    f"{mask(self.nodes[first])} is not a usable AMQP URL ({error}): "
                    "use amqp://user:password@host:port/vhost"
                ) from None
            except (OSError, aiormq.exceptions.AMQPError) as error:
                failures.append(connect_failure(self.nodes[first], error))
                if len(self.nodes) > 1:
                    log.warning("%s; trying the next node", failures[-1])
                continue
            connection.reconnect_callbacks.add(self._on_reconnect)
            self.current = connection
            self._closed = asyncio.Event()
            return connection
        raise _worst(failures)

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
            self.node,
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


class Failover(aio_pika.RobustConnection):
    """aio-pika's robust connection over a list of nodes: a failed node hands over to the next.

    The reconnect loop is aio-pika's; this only moves `url` on to the next node when the
    connection to the current one is lost or an attempt to reach it fails.
    """

    def __init__(self, nodes: Sequence[str], first: int, options: dict[str, Any]) -> None:
        self.names = list(nodes)
        self.nodes = [make_url(node, **options) for node in nodes]
        self.index = first
        self.move_on = False
        """Whether the next attempt goes to the next node (set when this one failed)."""
        super().__init__(self.nodes[first], **options)

    @property
    def node(self) -> str:
        """The current node's URL, password masked."""
        return mask(self.names[self.index])

    def next_node(self) -> None:
        """Try the next node of the list at the next attempt."""
        if len(self.nodes) > 1:
            self.index = (self.index + 1) % len(self.nodes)
            self.url = self.nodes[self.index]
            if self.connection_attempt:  # connected before: reconnecting, not the first connect
                log.info("trying RabbitMQ at %s next", self.node)

    # aio-pika's private hook for one connection attempt (RobustConnection.__connect_transport).
    # The move to the next node waits for the next attempt, so that aio-pika's line about a
    # failed attempt names the node that failed.
    async def _RobustConnection__connect_transport(self) -> None:
        if self.move_on:
            self.move_on = False
            self.next_node()
        try:
            await super()._RobustConnection__connect_transport()  # type: ignore[misc]
        except BaseException:
            self.move_on = True
            raise

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        was_up = self.connected.is_set()  # else a failed attempt, which moves on by itself
        if was_up and not (self._close_called or self.is_closed):
            log.warning("lost the connection to RabbitMQ at %s", self.node)
            self.move_on = True
        await super()._on_connection_close(closing)


async def _connect(nodes: Sequence[str], first: int, options: dict[str, Any]) -> Failover:
    """A connected `Failover` starting at `nodes[first]`; a failed connect leaves no loop behind."""
    connection = Failover(nodes, first, options)
    try:
        await connection.connect(timeout=CONNECT_TIMEOUT)  # every later attempt's bound too
    except BaseException:
        await connection.close()
        raise
    return connection


def nodes_of(address: str) -> list[str]:
    """The node URLs of a transport address: one URL, or several separated by `;`."""
    nodes = node_urls(address)
    if not nodes:
        raise ConfigurationError(
            f"transport {mask(address)!r} names no broker: use amqp://user:password@host/vhost, "
            "or several such URLs separated by ';' for a cluster"
        )
    queries = {urlsplit(node).query for node in nodes}
    if len(queries) > 1:
        raise ConfigurationError(
            f"the URLs of {mask(address)!r} carry different query options "
            f"({' / '.join(sorted(queries))}): give every node the same ones"
        )
    return nodes


def take_option(address: str, name: str) -> tuple[str, str | None]:
    """The address without query option `name` (in every node's URL), and its value if given.

    Every node must give the same value, or none.
    """
    node_urls(address)
    values: dict[str | None, None] = {}
    nodes = []
    for node in split_urls(address):
        parts = urlsplit(node)
        query = parse_qsl(parts.query, keep_blank_values=True)
        value = next((v for k, v in query if k == name), None)
        if node.strip():
            values[value] = None
        kept = urlencode([(key, v) for key, v in query if key != name])
        nodes.append(node if value is None else parts._replace(query=kept).geturl())
    if len(values) > 1:
        given = " / ".join("none" if value is None else repr(value) for value in values)
        raise ConfigurationError(
            f"the URLs of transport {mask(address)!r} give different {name} options ({given}): "
            f"give every node the same ?{name}=..., or leave it out of every URL"
        )
    return ";".join(nodes), next(iter(values), None)


def _options(address: str, heartbeat: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "reconnect_interval" not in parse_qs(urlsplit(address).query):
        options["reconnect_interval"] = RECONNECT_INTERVAL
    if heartbeat is not None:
        options["heartbeat"] = heartbeat
    return options


def _worst(failures: Sequence[MersalError]) -> MersalError:
    """The error to raise when no node answered: a refusal before an unreachable node."""
    for failure in failures:
        if not isinstance(failure, Unreachable):
            return failure
    if len(failures) == 1:
        return failures[0]
    return Unreachable(
        f"cannot connect to any of {len(failures)} RabbitMQ nodes: "
        + "; ".join(str(failure) for failure in failures)
    )


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
