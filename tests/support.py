"""Helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import uuid
from base64 import b64encode
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar, overload

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from mersal import App, Header
from mersal.cli import main
from mersal.transport import Consumer, Outgoing, Transport, first_failure
from mersal.transport.limits import Limits
from mersal_rabbitmq import RabbitMQTransport

SBIN = "/usr/local/sbin:/usr/sbin:/sbin"

RABBITMQ_HOST = os.environ.get("MERSAL_TEST_RABBITMQ_HOST", "127.0.0.1")
"""Where the tests' RabbitMQ runs."""

MANAGEMENT_API = f"http://{RABBITMQ_HOST}:15672/api"
"""RabbitMQ's management API (`make services` enables the plugin)."""

POSTGRES_ADMIN = os.environ.get(
    "MERSAL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
"""The PostgreSQL database the tests create and drop their own databases from."""


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)]
"""The databases a storage test runs on: SQLite, and PostgreSQL (marked integration)."""


def unique(prefix: str) -> str:
    """A queue (or topic) name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


T = TypeVar("T")


@overload
async def eventually(
    condition: Callable[[], Awaitable[T]],
    what: str,
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


@overload
async def eventually(
    condition: Callable[[], T], what: str, *, timeout: float = ..., interval: float = ...
) -> T: ...


async def eventually(
    condition: Callable[[], Any],
    what: str,
    *,
    timeout: float = 5.0,
    interval: float = 0.005,
) -> Any:
    """Poll `condition` (sync or async) until it returns a truthy value, and return that value.

    After `timeout` seconds without one, fail with an AssertionError saying `what` was awaited
    and the last value `condition` returned.
    """
    last: object = "nothing: the condition never returned"
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            while True:
                value = condition()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value
                last = value
                await asyncio.sleep(interval)
    except TimeoutError:
        if not deadline.expired():
            raise
    raise AssertionError(f"not within {timeout}s: {what} (last seen: {last!r:.500})")


def rabbitmqctl(*args: str) -> str:
    """Run `rabbitmqctl -q ARGS` and return its output; fail the test if it fails."""
    command = shutil.which("rabbitmqctl", path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if command is None:
        raise FileNotFoundError("rabbitmqctl")
    result = subprocess.run(
        [command, "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr or result.stdout}")
    return result.stdout


def management(method: str, path: str, body: object = None) -> Any:
    """Call the management API as guest; its JSON answer (None when it has no body).

    Cheaper than `rabbitmqctl`, which boots an Erlang VM (about 1.4 s of CPU) for each call.
    """
    request = urllib.request.Request(
        f"{MANAGEMENT_API}/{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={
            "Authorization": "Basic " + b64encode(b"guest:guest").decode(),
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = response.read()
    return json.loads(answer) if answer else None


def add_vhost(name: str) -> None:
    """Create the vhost `name` with guest allowed everything (skips without a RabbitMQ)."""
    quoted = urllib.parse.quote(name, safe="")
    try:
        management("PUT", f"vhosts/{quoted}")
    except OSError as error:
        pytest.skip(f"RabbitMQ's management API is not available here: {error}")
    everything = {"configure": ".*", "write": ".*", "read": ".*"}
    management("PUT", f"permissions/{quoted}/guest", everything)


def delete_vhost(name: str) -> None:
    """Delete the vhost `name` and everything in it (nothing if it is gone)."""
    with suppress(urllib.error.HTTPError):  # 404: already gone
        management("DELETE", f"vhosts/{urllib.parse.quote(name, safe='')}")


@contextmanager
def private_vhost(prefix: str, host: str = RABBITMQ_HOST) -> Iterator[str]:
    """The AMQP URL of a new RabbitMQ vhost on `host`, deleted afterwards (skips without one)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    add_vhost(name)
    try:
        yield f"amqp://guest:guest@{host}/{name}"
    finally:
        delete_vhost(name)


DEFINITIONS = {
    "list_queues": ("queues", {"name", "type", "arguments", "durable", "auto_delete"}),
    "list_exchanges": ("exchanges", {"name", "type", "arguments", "durable", "auto_delete"}),
    "list_bindings": ("bindings", {"source_name", "destination_name", "routing_key"}),
}
"""The `list_*` commands whose columns are definitions, which the management API shows at
once (message counts and consumers it shows seconds late: those stay with `rabbitmqctl`)."""

API_COLUMN = {"source_name": "source", "destination_name": "destination"}


def rabbitmqctl_rows(*args: str) -> list[dict[str, Any]]:
    """The rows of `rabbitmqctl -q list_* -p VHOST COLUMNS`, as `--formatter json` gives them.

    Definitions are read from the management API, which costs no Erlang VM.
    """
    command, *rest = args
    if command in DEFINITIONS and len(rest) > 2 and rest[0] == "-p":
        path, known = DEFINITIONS[command]
        vhost, columns = rest[1], rest[2:]
        if set(columns) <= known:
            listed = management("GET", f"{path}/{urllib.parse.quote(vhost, safe='')}")
            return [{c: row.get(API_COLUMN.get(c, c)) for c in columns} for row in listed]
    rows: list[dict[str, Any]] = json.loads(rabbitmqctl(*args, "--formatter", "json") or "[]")
    return rows


def broker_channels(connection_name: str) -> int:
    """How many channels RabbitMQ counts on the connection named `connection_name`.

    The name is the one a client gives its connection (`?name=` in an aio-pika URL); exactly
    one open connection must carry it.
    """
    rows = rabbitmqctl_rows("list_connections", "channels", "client_properties")
    named = ["connection_name", "longstr", connection_name]
    counts = [row["channels"] for row in rows if named in row["client_properties"]]
    if len(counts) != 1:
        raise AssertionError(f"{len(counts)} connections named {connection_name!r}, not one")
    return int(counts[0])


def broker_consumers(vhost: str) -> Counter[str]:
    """How many consumers RabbitMQ counts on each queue of `vhost` that has any."""
    rows = rabbitmqctl_rows("list_consumers", "-p", vhost, "queue_name")
    return Counter(row["queue_name"] for row in rows)


Watched = TypeVar("Watched", App, RabbitMQTransport)


class Recorder:
    """Every message a raw consumer received from one queue: counted by message id, the bodies."""

    def __init__(self) -> None:
        self.ids: Counter[str] = Counter()
        self.messages: dict[str, AbstractIncomingMessage] = {}
        self.bodies: list[bytes] = []

    async def on_message(self, incoming: AbstractIncomingMessage) -> None:
        """Count one delivery (auto-acked)."""
        # the header carries an id too long for the property
        header = (incoming.headers or {}).get(Header.MESSAGE_ID)
        message_id = header if isinstance(header, str) else incoming.message_id or ""
        self.ids[message_id] += 1
        self.messages[message_id] = incoming
        self.bodies.append(incoming.body)

    def duplicates(self) -> dict[str, int]:
        """Message ids that arrived more than once, with how often."""
        return {message_id: n for message_id, n in self.ids.items() if n > 1}


class Broker:
    """The test's own aio-pika connection to a vhost: publish, count, get, declare; clean up."""

    def __init__(self, url: str, connection: AbstractConnection, channel: AbstractChannel) -> None:
        self.url = url
        self.connection = connection
        self.channel = channel
        self.to_delete: set[str] = set()
        self.apps: list[App] = []
        self.transports: list[RabbitMQTransport] = []

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str) -> AsyncIterator[Broker]:
        """A Broker on a new connection to `url`, cleaned up (see `close`) when the block ends."""
        connection = await aio_pika.connect(url)
        broker = cls(url, connection, await connection.channel())
        try:
            yield broker
        finally:
            await broker.close()

    async def close(self) -> None:
        """Stop the watched apps, close the connection, delete the leftovers on a new one."""
        try:
            for app in self.apps:
                await app.stop()
        finally:
            try:
                await self.connection.close()
            finally:
                # on a connection of its own: the test may have closed the first
                async with await aio_pika.connect(self.url) as cleanup:
                    channel = await cleanup.channel()
                    for name in sorted(self.leftovers()):
                        await channel.queue_delete(name)

    def watch(self, subject: Watched) -> Watched:
        """After the test, stop `subject` if an app, and delete the queues its transport made."""
        if isinstance(subject, RabbitMQTransport):
            transport = subject
        else:
            if subject not in self.apps:
                self.apps.append(subject)
            transport = subject.transport
        assert isinstance(transport, RabbitMQTransport), f"{subject!r} is not on RabbitMQ"
        self.transports.append(transport)
        return subject

    def app(self, name: str, **options: Any) -> App:
        """An app on this vhost, watched."""
        return self.watch(App(name, transport=self.url, **options))

    def leftovers(self) -> set[str]:
        """Every queue to delete after the test: `to_delete`, and the watched transports' ones."""
        return self.to_delete.union(*(transport.queues for transport in self.transports))

    async def declare(self, name: str, **options: Any) -> str:
        """Declare the queue `name` (deleted after the test); its name."""
        self.to_delete.add(name)
        await self.channel.declare_queue(name, **options)
        return name

    async def publish(self, message: aio_pika.Message, routing_key: str) -> None:
        """Publish a raw message through the default exchange."""
        await self.channel.default_exchange.publish(message, routing_key)

    async def get(self, queue: str, timeout: float = 5.0) -> AbstractIncomingMessage:
        """The next message in `queue` (acked), waiting up to `timeout` seconds."""
        amqp_queue = await self.channel.get_queue(queue, ensure=False)
        message = await eventually(
            lambda: amqp_queue.get(no_ack=True, fail=False),
            f"a message in {queue!r}",
            timeout=timeout,
            interval=0.02,
        )
        assert message is not None
        return message

    async def count(self, queue: str) -> int:
        """How many messages are ready in `queue` (a passive declare, on a channel of its own)."""
        channel = await self.connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)
        finally:
            if not channel.is_closed:
                await channel.close()

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists (a passive declare, on a channel of its own)."""
        return await self._found(lambda channel: channel.declare_queue(queue, passive=True))

    async def exchange_exists(self, exchange: str) -> bool:
        """Whether `exchange` exists (a passive declare, on a channel of its own)."""
        return await self._found(lambda channel: channel.declare_exchange(exchange, passive=True))

    async def _found(self, declare: Callable[[AbstractChannel], Awaitable[object]]) -> bool:
        channel = await self.connection.channel()
        try:
            await declare(channel)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        finally:
            if not channel.is_closed:
                await channel.close()
        return True

    async def delete(self, names: Iterable[str]) -> None:
        """Delete queues (missing ones are fine)."""
        for name in names:
            await self.channel.queue_delete(name)

    async def record(self, queue: str) -> Recorder:
        """Consume `queue` (auto-ack) on a channel of its own into a Recorder."""
        recorder = Recorder()
        channel = await self.connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        await amqp_queue.consume(recorder.on_message, no_ack=True)
        return recorder


class DelegatingTransport:
    """A transport that hands every call to `inner`: tests override what they change.

    `send` goes through `send_each`, so overriding `send_each` changes both.
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.address = inner.address

    @property
    def limits(self) -> Limits:
        """The inner transport's limits."""
        return self.inner.limits

    async def start(self) -> None:
        """Connect."""
        await self.inner.start()

    async def stop(self) -> None:
        """Disconnect."""
        await self.inner.stop()

    async def declare(self, queue: str, *, temporary: bool = False) -> None:
        """Declare a queue."""
        await self.inner.declare(queue, temporary=temporary)

    async def bind(self, queue: str, topic: str) -> None:
        """Bind a queue to a topic."""
        await self.inner.bind(queue, topic)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Send, raising the first failure."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Send each; for each, None or why not."""
        return await self.inner.send_each(messages)

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume from a queue."""
        return await self.inner.consume(queue, prefetch=prefetch)


@asynccontextmanager
async def postgres_database(migrate: bool) -> AsyncIterator[str]:
    """A new PostgreSQL database (migrated or empty) for one test, dropped afterwards."""
    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.engine import make_url

    from mersal_sqlalchemy.cli import upgrade

    name = f"mersal_test_{uuid.uuid4().hex}"
    try:
        admin = await asyncpg.connect(POSTGRES_ADMIN, timeout=5)
    except (OSError, asyncpg.PostgresError) as error:
        pytest.skip(f"PostgreSQL is not available at {POSTGRES_ADMIN}: {error}")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = make_url(POSTGRES_ADMIN).set(drivername="postgresql+asyncpg", database=name)
    rendered = url.render_as_string(hide_password=False)
    try:
        if migrate:
            await asyncio.to_thread(upgrade, rendered)
        yield rendered
    finally:
        admin = await asyncpg.connect(POSTGRES_ADMIN, timeout=5)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def sqlite_file(directory: Path) -> str:
    """The URL of a SQLite file in `directory` (not created yet)."""
    return f"sqlite+aiosqlite:///{directory / 'app.db'}"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def forwarding(port: int, to: int) -> AsyncIterator[None]:
    """Forward connections on 127.0.0.1:`port` to 127.0.0.1:`to` while the block runs."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", to)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


async def mersal(*argv: str) -> int:
    """Run `mersal ARGV` in this process (in a thread: it runs an event loop of its own)."""
    return await asyncio.to_thread(main, list(argv))


async def queue_types(vhost: str) -> dict[str, str]:
    """Each queue's type in the vhost."""
    rows = await asyncio.to_thread(rabbitmqctl_rows, "list_queues", "-p", vhost, "name", "type")
    return {row["name"]: row["type"] for row in rows}


class Terminal(io.StringIO):
    """A stream that says it is a terminal: what a person at the keyboard types, or sees."""

    def isatty(self) -> bool:
        """Yes, a terminal."""
        return True
