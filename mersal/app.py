"""The App: the public face of a service on the bus, delegating to the parts it assembles.

Registering fills the registries (`types`, `handlers`, routes, subscriptions, sagas); sending
goes through `mersal.sending` and `mersal.requests`; each delivery becomes an outcome in
`mersal.receiving` and is settled in `mersal.settle`; `start` connects the parts in order
and `stop` drains and disconnects them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar, overload

from lagom import Container

from mersal import plugins, settings, waiting
from mersal.context import MessageContext, OutgoingContext
from mersal.errors import ConfigurationError
from mersal.handlers import Handler, Handlers, M
from mersal.health import MAX_RELAY_LAG, Health, Parts, health_of
from mersal.messages import Envelope, TypeRegistry, check_message_class
from mersal.numbers import is_seconds
from mersal.observer import Observer
from mersal.observer import problems as observer_problems
from mersal.outbox import Storage
from mersal.pipeline import Pipeline, add_storage_steps, incoming_pipeline, outgoing_pipeline
from mersal.receiving import Receiver
from mersal.requests import Requests
from mersal.retry import RetryPolicy
from mersal.sagas import Saga, Sagas, check_subscriptions
from mersal.sending import Routes, Sender
from mersal.serialization import Codec, JsonCodec
from mersal.settings import Settings, Wiring
from mersal.settle import Settler
from mersal.starting import start_when_reachable
from mersal.timeouts import HandlerClock
from mersal.transaction import Commit, Transaction, id_namespace
from mersal.transport import (
    BindingPruner,
    Transport,
    declare_error_queue,
)
from mersal.transport.limits import limits_of
from mersal.urls import mask
from mersal.worker import Worker

R = TypeVar("R")
D = TypeVar("D")

log = logging.getLogger("mersal.app")


class App:
    """A service on the bus: its name is its input queue."""

    def __init__(
        self,
        name: str,
        *,
        transport: str | Transport | None = None,
        database: str | None = None,
        retry: RetryPolicy | None = None,
        concurrency: int = 32,
        container: Container | None = None,
        codec: Codec | None = None,
        max_body_size: int = 1024 * 1024,
        grace_period: float = 30.0,
        handler_timeout: float | None = 300.0,
        prefetch: int | None = None,
        consume: bool = True,
        partitions: int | None = None,
    ) -> None:
        self._settings = Settings(
            name,
            database=database,
            retry=retry if retry is not None else RetryPolicy(),
            concurrency=concurrency,
            codec=codec if codec is not None else JsonCodec(),
            max_body_size=max_body_size,
            grace_period=grace_period,
            handler_timeout=handler_timeout,
            prefetch=prefetch,
            consume=consume,
            partitions=partitions,
        )
        self._transport = plugins.transport_from(transport)
        self._clock = HandlerClock(self._settings.handler_timeout)
        self._types = TypeRegistry()
        self._handlers = Handlers(container)
        self._handlers.provide(App, lambda context: context.app)
        self._handlers.provide(MessageContext, lambda context: context)
        self._routes = Routes()
        self._subscriptions: list[type] = []
        self._sagas = Sagas(self, name, self.codec, self._handlers)
        self._incoming = incoming_pipeline(
            self.codec, self._types, self._handlers, self._clock, max_body_size
        )
        self._outgoing = outgoing_pipeline(
            self._types, name, self.codec, lambda: self._transport, replies=consume
        )
        self._sender = Sender(self, self._settings, self._types, self._routes, self._outgoing)
        self._requests = Requests(self, self._settings, self._types, self._sender)
        self._storage: Storage | None = None
        self._observer: Observer | None = None
        self._settler = Settler(self._transport, self.retry.error_queue)
        self._worker: Worker | None = None
        self._running = False
        self._stopping: asyncio.Future[None] | None = None
        self._starting: tuple[asyncio.Task[Any], asyncio.Event] | None = None  # a start's task
        self._waiting: tuple[asyncio.Task[Any], asyncio.Event] | None = None  # start(wait=...)
        self._log_messages = False
        self._receiving: Receiver | None = None

    def __repr__(self) -> str:
        return f"<App {self.name!r} on {mask(self._transport.address)}>"

    # What the app was given, and what it is made of.

    @property
    def settings(self) -> Settings:
        """What the app was given, checked."""
        return self._settings

    @property
    def name(self) -> str:
        """The app's name: its input queue."""
        return self._settings.name

    @property
    def retry(self) -> RetryPolicy:
        """How often a failing message is tried again, and where it goes then."""
        return self._settings.retry

    @property
    def codec(self) -> Codec:
        """How message bodies are encoded and decoded."""
        return self._settings.codec

    def set_concurrency(self, concurrency: int) -> None:
        """Handle up to `concurrency` messages at once (before start); the prefetch follows."""
        self._check_not_running("change the concurrency")
        self._settings = self._settings.with_concurrency(concurrency)
        self._sender.settings = self._requests.settings = self._settings

    @property
    def transport(self) -> Transport:
        """What carries the app's messages (set it before the app starts to use another)."""
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self._check_not_running("change the transport")
        self._transport = transport

    @property
    def types(self) -> TypeRegistry:
        """The message types the app knows by wire name: only these decode."""
        return self._types

    @property
    def handlers(self) -> Handlers:
        """Which handlers run for which message type, and their dependencies."""
        return self._handlers

    @property
    def incoming(self) -> Pipeline[MessageContext]:
        """The steps each attempt at a delivery goes through (change them before start)."""
        return self._incoming

    @property
    def outgoing(self) -> Pipeline[OutgoingContext]:
        """The steps each message sent goes through (change them before start)."""
        return self._outgoing

    @property
    def subscriptions(self) -> list[type]:
        """The event types the app subscribed to, in order."""
        return list(self._subscriptions)

    @property
    def sagas(self) -> Sagas:
        """The app's sagas: their registrations, and where their data lives."""
        return self._sagas

    @property
    def storage(self) -> Storage | None:
        """The outbox and inbox, once attached (with `App(database=...)`, at start)."""
        return self._storage

    @property
    def observer(self) -> Observer | None:
        """What hears of deliveries and sends no step sees (`mersal.telemetry`), if any."""
        return self._observer

    @property
    def settler(self) -> Settler:
        """What carries out each delivery's outcome."""
        return self._settler

    # Registration.

    def register(self, message_type: type[M], handler: Handler[M]) -> None:
        """Handle `message_type` (and its subclasses) with a handler class or async function.

        Accepted: `async def f(message: T)`, `(message: T, context: MessageContext)`, the
        context in any position or by keyword (found by its annotation), the unannotated
        `(message, context)`, an object with such an `async __call__`, and a class with
        `async def __call__(self, message: T)` built per message with its `__init__`
        dependencies injected. The message's annotation must accept `message_type` (it, a base,
        a union with either, `Any`, `object`, or none). A `ConfigurationError` refuses, here,
        a handler for another type, one taking no message, one with a required parameter
        nothing fills, and a sync function.
        """
        self._check_not_running("register handlers")
        if isinstance(handler, type) and _is_handler(message_type) and not _is_handler(handler):
            raise ConfigurationError(
                "app.register() takes the message class first, then the handler: "
                f"app.register({handler.__qualname__}, {_handler_name(message_type)})"
            )
        check_message_class(message_type, self.codec, "register")
        self._types.add(message_type)
        self._handlers.add(message_type, handler)

    def route(self, message_type: type, queue: str) -> None:
        """Send messages of `message_type` (and its subclasses) to `queue`."""
        self._check_not_running("route message types")
        check_message_class(message_type, self.codec, "route")
        self._routes.add(message_type, queue)
        self._types.add(message_type)

    def subscribe(self, message_type: type) -> None:
        """Receive every published `message_type` in this app's queue."""
        self._check_not_running("subscribe")
        check_message_class(message_type, self.codec, "subscribe", bases=False)
        check_subscriptions(self._sagas.specs, [message_type])
        self._types.add(message_type)
        if message_type not in self._subscriptions:
            self._subscriptions.append(message_type)

    def register_saga(self, saga: type[Saga[Any]], *, pessimistic: bool = False) -> None:
        """Run a saga: each message type it takes finds (or starts) its saga instance.

        Optimistic by default (a revision check at save; a conflict reruns the message at
        once); `pessimistic` locks the saga's row while the message is handled (FOR UPDATE).
        """
        self._check_not_running("register sagas")
        self._sagas.register(saga, pessimistic, self._subscriptions)
        for message_type in self._sagas.spec(saga).methods:
            self._types.add(message_type)

    async def saga_data(self, saga: type[Saga[D]], correlation: object) -> D | None:
        """The committed data of the saga with this correlation value, or None if none runs."""
        return await self._sagas.data(saga, correlation)

    def use_storage(self, storage: Storage) -> None:
        """Plug in an outbox and inbox (a storage adapter calls this): its steps join `incoming`."""
        self._check_not_running("attach a storage")
        if self._storage is not None:
            raise ConfigurationError(f"app {self.name!r} already has a storage attached")
        add_storage_steps(self._incoming, storage)
        self._storage = self._sagas.storage = storage

    def observe(self, observer: Observer) -> None:
        """Report deliveries, outcomes and the sends no step sees to `observer` (before start)."""
        self._check_not_running("observe the app")
        if self._observer is not None:
            raise ConfigurationError(f"app {self.name!r} has an observer already")
        lacking = observer_problems(observer)
        if lacking:
            raise ConfigurationError(
                f"app.observe({type(observer).__name__}): an observer needs "
                f"{', '.join(lacking)}: subclass mersal.observer.Observer, whose methods do "
                "nothing (and send_each just sends) until you override them"
            )
        self._observer = observer

    # Sending.

    async def send(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Send a command to the queue its type is routed to; returns the message id."""
        return await self._sender.send(message, headers, partition_key)

    async def send_local(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Send a message to this app's own queue; returns the message id."""
        return await self._sender.send_local(message, headers, partition_key)

    async def publish(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Publish an event to every app subscribed to its type; returns the message id."""
        return await self._sender.publish(message, headers, partition_key)

    async def defer(
        self,
        delay: float | timedelta,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
        to_self: bool = False,
    ) -> str:
        """Send a message to its route (or this app) to be delivered after `delay`.

        `to_self`: to this app's own queue whatever the type's route (a saga's timeout).
        """
        return await self._sender.defer(delay, message, headers, partition_key, to_self)

    async def reply(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Inside a handler: send `message` to the reply address of the message being handled."""
        return await self._sender.reply(message, headers, partition_key)

    @overload
    async def request(
        self,
        message: object,
        *,
        timeout: float = ...,
        reply_type: type[R],
        headers: Mapping[str, str] | None = ...,
        partition_key: str | None = ...,
    ) -> R: ...

    @overload
    async def request(
        self,
        message: object,
        *,
        timeout: float = ...,
        reply_type: None = ...,
        headers: Mapping[str, str] | None = ...,
        partition_key: str | None = ...,
    ) -> Any: ...

    async def request(
        self,
        message: object,
        *,
        timeout: float = 30.0,
        reply_type: type | None = None,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> Any:
        """Send a command now and wait for its reply (the replier calls `app.reply`).

        With `reply_type`, the reply's type is registered (so that it decodes), and a reply of
        another type raises `UnexpectedReply`.
        """
        return await self._requests.request(message, timeout, reply_type, headers, partition_key)

    @asynccontextmanager
    async def transaction(self, session: object = None) -> AsyncIterator[Transaction]:
        """Buffer every send in the block; they leave on a clean exit, never after an error.

        With a database, the sends become outbox rows in `session`'s transaction (or in a
        session of the app's own when none is given), committed at the end of the block.
        Inside a handler (or another block) it joins the transaction already there: the sends
        leave with the message's, and if the block raises, the whole attempt fails.
        """
        async with self._sender.transaction(session) as transaction:
            yield transaction

    def queue_for(self, message_type: type) -> str:
        """The queue `send` uses for a message type; a `ConfigurationError` if it has none."""
        return self._routes.queue_for(message_type)

    # Lifecycle.

    @property
    def log_messages(self) -> bool:
        """Log an INFO line per handled message (`mersal.handled`; `mersal run --log-messages`)."""
        return self._log_messages

    @log_messages.setter
    def log_messages(self, on: bool) -> None:
        self._log_messages = on
        if self._receiving is not None:  # running: from the next message on
            self._receiving.log_messages = on

    @property
    def running(self) -> bool:
        """Whether the app has started and not yet stopped."""
        return self._running

    @property
    def worker(self) -> Worker | None:
        """The worker pulling the app's deliveries, while it runs."""
        return self._worker

    @property
    def in_flight(self) -> int:
        """How many deliveries the worker is handling now."""
        return self._worker.in_flight if self._worker is not None else 0

    @property
    def healthy(self) -> bool:
        """Running, still receiving, and no outbox row parked for an operator to deal with."""
        return (
            self._running
            and (
                not self._settings.consume
                or (self._worker is not None and self._worker.failed is None)
            )
            and (self._storage is None or not self._storage.parked)
        )

    def health(self, *, max_relay_lag: float = MAX_RELAY_LAG) -> Health:
        """Whether the app is alive and ready, and why not (see `mersal.health`); no I/O."""
        storage = self._storage
        parts = Parts(
            self.name,
            self._running,
            self._worker,
            storage is not None,
            storage.relay if storage is not None else None,
            self._transport,
        )
        return health_of(parts, max_relay_lag)

    async def start(self, *, wait: float = 0.0) -> None:
        """Declare the queues, bind the subscriptions and start the worker.

        `wait`: seconds to keep trying while the broker or the database does not answer (as
        `mersal run --wait` does, each try logged), for an app started inside a web server's
        lifespan; 0 fails at the first `Unreachable`. Cancel the awaiting task, or call `stop()`,
        to stop waiting.
        """
        if self._running:
            return
        if not is_seconds(wait, infinite=True):
            raise ConfigurationError(
                f"start(wait={wait!r}) must be a number of seconds >= 0 (0: do not wait)"
            )
        task = asyncio.current_task()
        assert task is not None
        underway = (task, asyncio.Event())
        try:
            if wait > 0:  # each try is a start(wait=0) of its own; stop() cancels this task
                self._waiting = underway
                await start_when_reachable(self, wait, hint="start(wait=SECONDS)", log=log)
            else:
                self._starting = underway
                await self._start()
        finally:
            if self._waiting is underway:
                self._waiting = None
            if self._starting is underway:
                self._starting = None
            underway[1].set()

    async def _start(self) -> None:
        """Check the whole app, connect its parts in order, and start receiving."""
        if self._settings.database is not None and self._storage is None:
            attached = plugins.storage_for(
                self, self._settings.database
            )  # it provides AsyncSession
            if self._storage is None:  # the adapter's factory may have plugged it in itself
                self.use_storage(attached)
        wiring = self._wiring()
        settings.check_at_start(wiring, limits_of(self._transport), self._transport.address)
        self._handlers.check()
        if self._sagas.specs:
            self._sagas.store()
            check_subscriptions(self._sagas.specs, self._subscriptions)
        self._incoming.freeze()
        self._outgoing.freeze()
        transport = self._transport
        self._settler = Settler(transport, self.retry.error_queue)
        storage = self._storage
        commit = storage.commit if storage is not None else self._sender.publish_committed
        await self._connect(transport, commit)
        self._sender.open(transport, commit, storage, self._observer)
        self._requests.open(self._settler)
        self._running = True
        if self._worker is not None:
            self._worker.start()
            settings.warn_at_start(wiring)
        log.info(
            "app %r started on %s%s",
            self.name,
            mask(transport.address),
            "" if self._settings.consume else " (send-only)",
        )

    def _wiring(self) -> Wiring:
        return Wiring(
            self._settings,
            self._routes.queues,
            self._subscriptions,
            self._handlers.message_types,
            self._sagas.timeouts,
            self._incoming.names,
        )

    async def _connect(self, transport: Transport, commit: Commit) -> None:
        """Start the transport, declare and bind, start the storage, open the consumer."""
        await transport.start()
        try:
            if self._settings.consume:
                await self._declare_input(transport)
                await declare_error_queue(transport, self.retry.error_queue)
                await self._bind_subscriptions(transport)
            if self._storage is not None:
                await self._storage.start()
            if self._settings.consume:
                consumer = await transport.consume(self.name, prefetch=self._settings.window)
                self._worker = Worker(
                    consumer,
                    self._receiver(commit),
                    self._settler,
                    concurrency=self._settings.concurrency,
                )
        except BaseException:
            self._worker = None
            if self._storage is not None:
                await self._storage.stop()
            await transport.stop()
            raise

    def _receiver(self, commit: Commit) -> Receiver:
        """What turns each of the app's deliveries into an outcome, committing with `commit`."""
        owner, ids = self, id_namespace(self.name)

        def new_transaction(envelope: Envelope) -> Transaction:
            return Transaction(commit, owner, envelope, ids)

        self._receiving = Receiver(
            self,
            self._incoming,
            self.retry,
            self._settler,
            new_transaction,
            observer=self._observer,
            log_messages=self._log_messages,
        )
        return self._receiving

    async def _declare_input(self, transport: Transport) -> None:
        """Declare the app's queue, and its partitions if it has any."""
        partitions = self._settings.partitions
        if not partitions:
            await transport.declare(self.name)
            return
        try:
            await transport.declare(self.name, partitions=partitions)
        except TypeError as error:
            if "partitions" not in str(error):
                raise
            raise ConfigurationError(
                f"App(partitions={partitions}) needs a transport that partitions queues; "
                f"{mask(transport.address)} does not: use RabbitMQ, or leave partitions out"
            ) from None

    async def _bind_subscriptions(self, transport: Transport) -> None:
        """Bind the input queue to each subscribed topic, and unbind it from any other."""
        topics = [self._types.name_of(message_type) for message_type in self._subscriptions]
        for topic in topics:
            await transport.bind(self.name, topic)
        if isinstance(transport, BindingPruner):  # an earlier start may have subscribed to more
            await transport.prune_bindings(self.name, topics)

    async def stop(self) -> None:
        """Stop fetching, finish in-flight messages (within the grace period), disconnect.

        During a `start()` in another task (waiting between tries too), that start is cancelled
        and undoes what it did.
        """
        if self._stopping is None:
            if not self._running:
                await self._abort_start()
                return
            self._stopping = asyncio.ensure_future(self._shut_down())
        stopping = self._stopping
        try:
            await asyncio.shield(stopping)
        finally:
            if stopping.done() and self._stopping is stopping:
                self._stopping = None

    async def _abort_start(self) -> None:
        """Cancel a start() under way in another task, and wait until it has undone its work."""
        underway = self._waiting or self._starting
        if underway is None or underway[0] is asyncio.current_task():
            return
        underway[0].cancel()
        await underway[1].wait()

    async def _shut_down(self) -> None:
        began = time.monotonic()
        grace = self._settings.grace_period
        if log.isEnabledFor(logging.INFO):  # it may count the outbox's rows: only when shown
            running = waiting.running_handlers(self._types, self._worker)
            log.info("%s", await waiting.stopping(self.name, grace, running, self._storage))
        unfinished = 0
        if self._worker is not None:
            unfinished = await self._worker.stop(grace)
        self._worker = None
        await self._clock.stop()
        self._running = False
        self._sender.close()
        if self._storage is not None:
            await self._storage.stop()
        await self._requests.close()
        await self._transport.stop()
        ended = waiting.stopped(self.name, grace, time.monotonic() - began, unfinished)
        log.log(logging.WARNING if unfinished else logging.INFO, "%s", ended)

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _check_not_running(self, what: str) -> None:
        if self._running:
            raise ConfigurationError(f"{what} before app {self.name!r} starts")


def _is_handler(thing: object) -> bool:
    """Whether `thing` looks like a handler: a function, or a class or object with a
    `__call__` of its own (a message class has neither)."""
    call = getattr(thing, "__call__", None)  # noqa: B004
    return inspect.isfunction(thing) or inspect.isfunction(call) or inspect.ismethod(call)


def _handler_name(handler: object) -> str:
    """How a handler is written in a call: its name, or its class's for an object."""
    name = getattr(handler, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(handler).__qualname__}(...)"
