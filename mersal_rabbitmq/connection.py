"""The connection to RabbitMQ, its channels, and the one registry of what it restores.

The connection is a plain aio-pika connection, reconnected here (no robust connection or
channel of aio-pika's: nothing restores itself behind the registry's back). Whatever must come
back registers a restore callback with the connection: the topology (every exchange, queue and
binding declared) and each consumer (its channel, its queue, its subscription). After every
reconnect each registered callback runs again, once connected. An object that lost its channel
while the connection stayed up (a channel error, or the broker cancelling a consumer whose
queue was deleted) asks its own registration for a restore: the same callback, the same
bounded retries, then the object hears that it is lost. Publishing channels register nothing:
a closed one is replaced when it is next needed.

Failover: the address may list several nodes of a cluster, full URLs separated by `;` (as
kombu takes them). The first that answers is used. When its connection is lost, a round of
attempts starts at once with the next node and goes round the list; a round in which no node
answered is followed by a pause (the URL's `reconnect_interval`, 1 s by default, doubled after
each such round up to `MAX_PAUSE`) and one log line naming each node's reason. The restores
run on whichever node answered. Logs name the node.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.connection import make_url

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.urls import mask, split_urls
from mersal_rabbitmq import patches
from mersal_rabbitmq.urls import node_urls

log = logging.getLogger("mersal.rabbitmq")

RECONNECT_INTERVAL = 1.0
"""Seconds of the first pause after a round of reconnect attempts in which no node answered,
unless the URL's `reconnect_interval` says otherwise; each further such round doubles it."""
MAX_PAUSE = 30.0
"""The longest pause between two rounds of reconnect attempts."""
MAX_OPTION_SECONDS = 3600.0
"""The longest `reconnect_interval` a URL may give (longer is a mistake: an app that never
tries again)."""
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
    """One connection to RabbitMQ (to one node of a list), plain channels on it, and what it
    restores after each reconnect."""

    def __init__(self, address: str) -> None:
        self.address = address
        address, interval = take_option(address, "reconnect_interval")
        self.nodes = nodes_of(address)
        """The URLs of the nodes to try, in order: one, or several for failover."""
        self.pause = _seconds(interval, "reconnect_interval") if interval else RECONNECT_INTERVAL
        """Seconds of the first pause after a round of reconnect attempts that all failed."""
        self.index = 0
        """The node connected to, or to be tried next: an index into `nodes`."""
        self.current: AbstractConnection | None = None
        """The aio-pika connection while open (the last one while reconnecting), else None."""
        self._options: dict[str, Any] = {}
        self._registrations: dict[Registration, None] = {}  # a dict keeps registration order
        self._closed = asyncio.Event()  # wakes whoever waits for a reconnect, at close()
        self._up = asyncio.Event()  # set while `current` is connected
        self._reconnecting: asyncio.Task[None] | None = None

    @property
    def node(self) -> str:
        """The URL (password masked) of the node connected to, or to be tried next."""
        return mask(self.nodes[self.index])

    def require(self) -> AbstractConnection:
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

    async def open(self, heartbeat: int | None) -> AbstractConnection:
        """Connect to the first node that answers; from now on, every reconnect restores."""
        self._options = {} if heartbeat is None else {"heartbeat": heartbeat}
        failures: list[MersalError] = []
        for index in range(len(self.nodes)):
            try:
                connection = await self._attempt(index)
            except ValueError as error:
                raise ConfigurationError(
                    f"{mask(self.nodes[index])} is not a usable AMQP URL ({error}): "
                    "use amqp://user:password@host:port/vhost"
                ) from None
            except (OSError, aiormq.exceptions.AMQPError) as error:
                failures.append(connect_failure(self.nodes[index], error))
                if index + 1 < len(self.nodes):
                    log.warning("%s; trying the next node", failures[-1])
                continue
            self._closed = asyncio.Event()
            self._attach(connection, index)
            return connection
        raise _worst(failures)

    async def close(self) -> None:
        """Restore nothing more, stop reconnecting, and disconnect."""
        connection, self.current = self.current, None
        self._closed.set()
        self._up.clear()
        reconnecting, self._reconnecting = self._reconnecting, None
        if reconnecting is not None and not reconnecting.done():
            reconnecting.cancel()
            await asyncio.gather(reconnecting, return_exceptions=True)
        for registration in list(self._registrations):
            await registration.cancel()
        if connection is not None:
            await connection.close()

    async def ready(self) -> None:
        """Wait until the connection is up (it reconnects by itself); raises once closed."""
        self.require()
        if self.connected:
            return
        reconnected = asyncio.ensure_future(self._up.wait())
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
            await patches.guard(channel)
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

    async def _attempt(self, index: int) -> AbstractConnection:
        """A connection to node `index`, within `CONNECT_TIMEOUT`, read the way Mersal reads."""
        url = make_url(self.nodes[index], **self._options)
        connecting = patches.own_context()  # the connection's reader task inherits it
        return await asyncio.create_task(_connect(url), context=connecting)

    def _attach(self, connection: AbstractConnection, index: int) -> None:
        self.current, self.index = connection, index
        connection.close_callbacks.add(self._on_close)
        self._up.set()
        if not connection.connected.is_set():  # closed before the callback was there to hear it
            self._on_close(connection, None)

    def _on_close(self, connection: object, error: BaseException | None) -> None:
        if connection is not self.current or self._closed.is_set():
            return  # an earlier connection, or closed by close()
        self._up.clear()
        if self._reconnecting is None or self._reconnecting.done():
            own = contextvars.Context()  # nothing of the closing reader's context
            self._reconnecting = asyncio.create_task(
                self._reconnect(error), name="mersal-rabbitmq reconnect", context=own
            )

    async def _reconnect(self, error: BaseException | None) -> None:
        """Rounds of attempts over the nodes, the lost one last, pausing longer each time."""
        lost, count = self.index, len(self.nodes)
        order = [(lost + step) % count for step in range(1, count + 1)]
        then = f"trying {mask(self.nodes[order[0]])} next" if count > 1 else "reconnecting"
        log.warning("lost the connection to RabbitMQ at %s (%s); %s", self.node, why(error), then)
        pause, lost_connection = self.pause, self.current
        while True:
            passed: list[str] = []
            for index in order:
                try:
                    connection = await self._attempt(index)
                except Exception as failure:
                    passed.append(f"{mask(self.nodes[index])}: {reason(failure)}")
                    log.debug("reconnecting to RabbitMQ: %s", passed[-1])
                    continue
                self._attach(connection, index)
                if not self._up.is_set():  # lost again at once
                    passed.append(f"{mask(self.nodes[index])}: closed as it opened")
                    continue
                self._on_reconnect(passed)
                await _close_lost(lost_connection)
                return
            log.warning("%s; next round in %g s", _round_failed(passed), pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, max(MAX_PAUSE, self.pause))

    def _on_reconnect(self, passed: Sequence[str]) -> None:
        log.info(
            "reconnected to RabbitMQ at %s%s; declaring the topology again and consuming again",
            self.node,
            f" (passed over {'; '.join(passed)})" if passed else "",
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


def nodes_of(address: str) -> list[str]:
    """The node URLs of a transport address: one URL, or several separated by `;`."""
    nodes = node_urls(address)
    if not nodes:
        raise ConfigurationError(
            f"transport {mask(address)!r} names no broker: use amqp://user:password@host/vhost, "
            "or several such URLs separated by ';' for a cluster"
        )
    queries = {urlsplit(node).query: _options(node) for node in nodes}
    if len(set(queries.values())) > 1:
        raise ConfigurationError(
            f"the URLs of {mask(address)!r} carry different query options "
            f"({' / '.join(sorted(queries))}): give every node the same ones"
        )
    return nodes


def _options(node: str) -> tuple[tuple[str, str], ...]:
    """A URL's query options as they are read: in any order, numbers by their value."""
    query = parse_qsl(urlsplit(node).query, keep_blank_values=True)
    return tuple(sorted((key, str(_value(value))) for key, value in query))


def _value(value: str) -> object:
    """A number as its value (2 and 2.0 are one), other text as it is."""
    try:
        number = float(value)
    except ValueError:
        return value
    return number if number == number else value


def take_option(address: str, name: str) -> tuple[str, str | None]:
    """The address without query option `name` (in every node's URL), and its value if given.

    Every node must give the same value, or none.
    """
    node_urls(address)
    values: dict[object, str | None] = {}  # each value as read: as written the first time
    nodes = []
    for node in split_urls(address):
        parts = urlsplit(node)
        query = parse_qsl(parts.query, keep_blank_values=True)
        value = next((v for k, v in query if k == name), None)
        if node.strip():
            values.setdefault(None if value is None else _value(value), value)
        kept = urlencode([(key, v) for key, v in query if key != name])
        nodes.append(node if value is None else parts._replace(query=kept).geturl())
    if len(values) > 1:
        given = " / ".join("none" if value is None else repr(value) for value in values.values())
        raise ConfigurationError(
            f"the URLs of transport {mask(address)!r} give different {name} options ({given}): "
            f"give every node the same ?{name}=..., or leave it out of every URL"
        )
    return ";".join(nodes), next(iter(values.values()), None)


async def _connect(url: Any) -> AbstractConnection:
    """A connected plain aio-pika connection to `url`; a failed attempt leaves nothing open."""
    connection = aio_pika.Connection(url)
    try:
        await connection.connect(timeout=CONNECT_TIMEOUT)
    except BaseException:
        await connection.close()
        raise
    return connection


async def _close_lost(connection: AbstractConnection | None) -> None:
    """Let go of a connection that was lost (its socket is gone already)."""
    if connection is None:
        return
    try:
        await connection.close()
    except Exception as error:
        log.debug("closing a lost connection failed: %s", error)


def _seconds(value: str, name: str) -> float:
    """A URL option's number of seconds: more than 0, at most MAX_OPTION_SECONDS."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_OPTION_SECONDS:
        raise ConfigurationError(
            f"{name}={value!r} in the transport URL is not a number of seconds from 0 to "
            f"{MAX_OPTION_SECONDS:g}: write {name}=1 (or any such number)"
        )
    return seconds


def _round_failed(passed: Sequence[str]) -> str:
    """The line for a round of reconnect attempts in which no node answered."""
    if len(passed) == 1:
        return f"reconnecting to RabbitMQ failed ({passed[0]})"
    return f"all {len(passed)} RabbitMQ nodes failed ({'; '.join(passed)})"


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
    if isinstance(error, OSError) or isinstance(error.__cause__, OSError):
        return Unreachable(
            f"cannot connect to RabbitMQ at {mask(address)}: {reason(error)}; "
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


def reason(error: BaseException) -> str:
    """Why an attempt to connect failed, for a message or a log line."""
    if isinstance(error, TimeoutError):  # raised bare by the attempt's time limit
        return f"no answer within {CONNECT_TIMEOUT:g} s"
    return why(error)


def why(error: BaseException | None) -> str:
    """An error for a message or a log line: its type and text, or that none was given."""
    if error is None:
        return "no reason given"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__}, no reason given"
