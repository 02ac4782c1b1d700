"""Sending: where each message goes, the outgoing pipeline, and the transaction it joins.

`send`, `send_local`, `publish`, `defer` and `reply` name a destination and hand the message to
the outgoing pipeline (`mersal.pipeline`). Inside a handler, or an `app.transaction()` block,
the message joins the current transaction and leaves when it commits: as outbox rows with a
storage, else handed to the transport (`publish_committed`).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta

from mersal.context import MessageContext, OutgoingContext, current_message
from mersal.errors import ConfigurationError, MersalError, NotRunning, Unsendable
from mersal.messages import Header, TypeRegistry, check_sendable, describe
from mersal.observer import Observer, send_each
from mersal.outbox import Storage, unreachable_reply
from mersal.pipeline import Pipeline, check_headers, partition_key_text
from mersal.settings import Settings, check_queue_name
from mersal.settle import Failure
from mersal.transaction import Commit, Transaction, TransactionClosed, current_transaction
from mersal.transport import Transport
from mersal.transport.limits import limits_of


class Routes:
    """Which queue `send` uses for each message type (and its subclasses)."""

    def __init__(self) -> None:
        self.queues: dict[type, str] = {}

    def add(self, message_type: type, queue: str) -> None:
        """Send messages of `message_type` (and its subclasses) to `queue`."""
        check_queue_name(queue, f"route({message_type.__qualname__}, queue)")
        self.queues[message_type] = queue

    def get(self, message_type: type) -> str | None:
        """The queue of the type or its nearest routed base, if any."""
        queues = self.queues
        for cls in message_type.__mro__:
            queue = queues.get(cls)
            if queue is not None:
                return queue
        return None

    def queue_for(self, message_type: type) -> str:
        """The queue `send` uses for a message type; a `ConfigurationError` if it has none."""
        queue = self.get(message_type)
        if queue is None:
            name = message_type.__qualname__
            raise ConfigurationError(
                f"{name} has no route: call app.route({name}, 'queue-name') before sending it"
            )
        return queue


class Sender:
    """An app's sends: each message's address, then the outgoing pipeline, while it runs."""

    def __init__(
        self,
        owner: object,
        settings: Settings,
        types: TypeRegistry,
        routes: Routes,
        outgoing: Pipeline[OutgoingContext],
    ) -> None:
        self.owner = owner
        """The App whose handlers' and blocks' transactions the sends join."""
        self.settings = settings
        self.types = types
        self.routes = routes
        self.outgoing = outgoing
        self.transport: Transport | None = None
        """Where committed messages go while the app runs (None before start and after stop)."""
        self.commit: Commit = self.publish_committed
        """How the app's transactions commit: outbox rows with a storage, else a publish."""
        self.storage: Storage | None = None
        self.observer: Observer | None = None

    def open(
        self,
        transport: Transport,
        commit: Commit,
        storage: Storage | None,
        observer: Observer | None,
    ) -> None:
        """Send through `transport` from now on, committing blocks with `commit`."""
        self.transport, self.commit = transport, commit
        self.storage, self.observer = storage, observer

    def close(self) -> None:
        """Refuse sends from now on (`NotRunning`)."""
        self.transport = None

    async def send(
        self, message: object, headers: Mapping[str, str] | None, partition_key: str | None
    ) -> str:
        """Send a command to the queue its type is routed to; returns the message id."""
        check_sendable(message, self.settings.codec)
        queue = self.routes.queue_for(type(message))
        return await self.emit(message, queue, False, headers, partition_key)

    async def send_local(
        self, message: object, headers: Mapping[str, str] | None, partition_key: str | None
    ) -> str:
        """Send a message to this app's own queue; returns the message id."""
        check_sendable(message, self.settings.codec)
        self.check_own_queue("send_local()")
        return await self.emit(message, self.settings.name, False, headers, partition_key)

    async def publish(
        self, message: object, headers: Mapping[str, str] | None, partition_key: str | None
    ) -> str:
        """Publish an event to every app subscribed to its type; returns the message id."""
        check_sendable(message, self.settings.codec)
        topic = self.types.name_of(type(message))
        return await self.emit(message, topic, True, headers, partition_key)

    async def defer(
        self,
        delay: float | timedelta,
        message: object,
        headers: Mapping[str, str] | None,
        partition_key: str | None,
        to_self: bool,
    ) -> str:
        """Send a message to its route (or this app, `to_self`) to be delivered after `delay`."""
        check_sendable(message, self.settings.codec)
        if isinstance(delay, bool) or not isinstance(delay, int | float | timedelta):
            raise Unsendable(
                f"defer({delay!r}, ...) needs a delay in seconds (a number) or a timedelta"
            )
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        limit = limits_of(self.transport).max_delay
        if not math.isfinite(seconds) or seconds > limit:
            raise Unsendable(
                f"defer({delay!r}, ...) needs a finite delay of at most {limit:.0f}s, the longest "
                "the transport can hold a message"
            )
        merged = check_headers(headers)
        merged[Header.DELIVER_AT] = f"{time.time() + max(0.0, seconds):.6f}"
        queue = None if to_self else self.routes.get(type(message))
        if queue is None:
            what = "to itself" if to_self else "that has no route"
            self.check_own_queue(f"defer() a {type(message).__qualname__} {what}")
            queue = self.settings.name
        return await self.emit(message, queue, False, merged, partition_key)

    async def reply(
        self, message: object, headers: Mapping[str, str] | None, partition_key: str | None
    ) -> str:
        """Inside a handler: send `message` to the reply address of the message being handled."""
        check_sendable(message, self.settings.codec)
        incoming = current_message.get()
        if incoming is None or incoming.app is not self.owner:
            raise MersalError("reply() works only inside a handler of this app")
        reply_to = incoming.reply_to
        if not reply_to:
            raise MersalError(
                f"{describe(incoming.headers)} has no reply-to header, so there is nowhere to reply"
            )
        merged = check_headers(headers)
        merged[Header.REPLY] = "true"
        if incoming.headers.get(Header.TEMPORARY_REPLY_TO) == "true":
            merged[Header.TEMPORARY_REPLY_TO] = "true"
        return await self.emit(message, reply_to, False, merged, partition_key)

    async def emit(
        self,
        message: object,
        address: str,
        publish: bool,
        headers: Mapping[str, str] | None,
        partition_key: str | None,
        *,
        direct: bool = False,
    ) -> str:
        """Run a message through the outgoing pipeline, in the current transaction unless
        `direct`; returns its id."""
        self.check_running()
        merged = check_headers(headers) if headers else {}
        if partition_key is not None:
            merged[Header.PARTITION_KEY] = partition_key_text(partition_key)
        context = OutgoingContext(
            message,
            address,
            publish,
            merged,
            self.incoming(),
            None if direct else self.joined(),
        )
        await self.outgoing.run(context)
        return context.headers[Header.MESSAGE_ID]

    def incoming(self) -> MessageContext | None:
        """The message this app's handler is handling in this task, if any."""
        incoming = current_message.get()
        return incoming if incoming is not None and incoming.app is self.owner else None

    def joined(self) -> Transaction | None:
        """The transaction of this app a send joins in this task, if any."""
        transaction = current_transaction.get()
        return transaction if transaction is not None and transaction.owner is self.owner else None

    async def publish_committed(self, transaction: Transaction) -> None:
        """Commit without an outbox: hand the messages to the transport, in order.

        Every message is tried; the first failure is raised. A reply whose requester's temporary
        queue is gone is dropped (logged): it has no one to reach.
        """
        outgoing = transaction.outgoing
        if not outgoing:
            return
        transport = self.transport
        if transport is None:
            raise NotRunning(f"app {self.settings.name!r} stopped before its transaction committed")
        results = await send_each(self.observer, transport, outgoing, detached=False)
        for sent, result in zip(outgoing, results, strict=True):
            if result is not None and not unreachable_reply(sent, result):
                raise result

    @asynccontextmanager
    async def transaction(self, session: object) -> AsyncIterator[Transaction]:
        """Buffer every send in the block; they leave on a clean exit, never after an error.

        Inside a handler (or another block) it joins the transaction already there.
        """
        self.check_running()
        current = current_transaction.get()
        if current is not None and current.owner is self.owner:
            if not current.open:  # a task left behind by an attempt or a block that has ended
                raise TransactionClosed(
                    "this code runs in a transaction that has ended (a task the handler or "
                    "block left behind): send from inside the handler or block"
                )
            async with _joined(current, session) as joined:
                yield joined
            return
        if self.storage is None and session is not None:
            raise ConfigurationError(
                "app.transaction(session) writes to the outbox, which needs App(database=...)"
            )
        async with self._block(session) as transaction:
            token = current_transaction.set(transaction)
            try:
                yield transaction
            finally:
                current_transaction.reset(token)

    def _block(self, session: object) -> AbstractAsyncContextManager[Transaction]:
        """A block's own transaction: in the storage's session, or buffered for a publish."""
        if self.storage is not None:
            return self.storage.transaction(session)
        return _buffered(Transaction(self.commit, self.owner))

    def check_running(self) -> None:
        """Raise `NotRunning` unless the app runs."""
        if self.transport is None:
            raise NotRunning(
                f"app {self.settings.name!r} is not running: `await app.start()` or "
                "`async with app:` first"
            )

    def check_own_queue(self, what: str) -> None:
        """Refuse `what` (a send to the app's own queue) in a send-only app, which has none."""
        if not self.settings.consume:
            raise ConfigurationError(
                f"app {self.settings.name!r} is send-only (consume=False) and has no queue of its "
                f"own, so it cannot {what}: route the type to the app that handles it (app.route)"
            )


@asynccontextmanager
async def _joined(transaction: Transaction, session: object) -> AsyncIterator[Transaction]:
    """The transaction already there, for a block inside it; a failed block dooms it."""
    if session is not None and session is not transaction.session:
        raise ConfigurationError(
            "app.transaction(session) inside a handler joins the message's own transaction, "
            "which writes through the message's session: pass that session (ask for "
            "AsyncSession in the handler) or none"
        )
    try:
        yield transaction
    except BaseException as error:
        transaction.doom(
            f"an app.transaction() block inside the transaction failed ({Failure.of(error)}), "
            "so the transaction cannot commit"
        )
        raise


@asynccontextmanager
async def _buffered(transaction: Transaction) -> AsyncIterator[Transaction]:
    """A block's own transaction without a storage: its sends are published on a clean exit."""
    try:
        yield transaction
    except BaseException:
        transaction.rollback()
        raise
    await transaction.commit()
