"""The App: handlers, routes and subscriptions; send, publish, defer, reply, request; lifecycle."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

from lagom import Container

from mersal import waiting
from mersal.errors import (
    ConfigurationError,
    DecodeError,
    MersalError,
    NotRunning,
    RequestTimeout,
    UnexpectedReply,
    Unsendable,
)
from mersal.handlers import Handler, Handlers, M
from mersal.health import MAX_RELAY_LAG, Health, check
from mersal.logs import log_handled
from mersal.messages import (
    Header,
    TypeRegistry,
    check_message_class,
    check_sendable,
    describe,
    new_id,
)
from mersal.outbox import Storage, attach_storage, unreachable_reply
from mersal.pipeline import (
    MessageContext,
    OutgoingContext,
    add_storage_steps,
    check_headers,
    current_message,
    incoming_pipeline,
    outgoing_pipeline,
    partition_key_text,
)
from mersal.plugins import transport_from
from mersal.retry import RetryPolicy, RetryStep, after_failure, attempts_made, log_failure
from mersal.sagas import (
    MemorySagaStore,
    Saga,
    SagaRunner,
    SagaSpec,
    SagaStore,
    check_subscriptions,
    saga_data,
    saga_spec,
)
from mersal.serialization import Codec, JsonCodec
from mersal.settle import (
    ACK,
    Failure,
    Outcome,
    Settler,
    absorb_cancellation,
    cancelled_by_owner,
)
from mersal.starting import start_when_reachable
from mersal.timeouts import HandlerClock
from mersal.transaction import (
    Transaction,
    TransactionClosed,
    current_transaction,
    id_namespace,
)
from mersal.transport import (
    BindingPruner,
    Consumer,
    Delivery,
    Outgoing,
    Transport,
    declare_error_queue,
)
from mersal.transport.limits import Limits, limits_of
from mersal.urls import mask
from mersal.worker import Worker

if TYPE_CHECKING:
    from mersal.telemetry import Telemetry

R = TypeVar("R")
D = TypeVar("D")

log = logging.getLogger("mersal.app")

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}")
MAX_PREFETCH = 65_535  # an AMQP prefetch count is 16 bits
MAX_PARTITIONS = 256
WAITING_PER_SLOT = 8
STOPPED_SHORT = Failure(
    "mersal.errors.MersalError",
    "the incoming pipeline ended early and no step decided what becomes of the message: a step "
    "that does not call next must set context.outcome",
)


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
        check_queue_name(name, "App(name)")
        check_concurrency(concurrency)
        self.prefetch = check_prefetch(prefetch, concurrency)
        self.handler_timeout = check_timeout(handler_timeout)
        self.clock = HandlerClock(self.handler_timeout)
        self.name = name
        self.message_ids = id_namespace(name)
        self._transport = transport_from(transport)
        self.database = database or os.environ.get("MERSAL_DATABASE") or None
        self.retry = retry if retry is not None else RetryPolicy()
        check_queue_name(self.retry.error_queue, "RetryPolicy(error_queue)")
        if self.retry.error_queue == name:
            raise ConfigurationError(
                f"RetryPolicy(error_queue={name!r}) is the app's own queue: dead letters would "
                "come back to be handled again; name another queue"
            )
        self.concurrency = concurrency
        self.consume = consume
        """False for a send-only app: no input or error queue, no worker; sends and relays."""
        self.partitions = check_partitions(partitions, consume)
        """How many ordered partitions the app's input is split into by partition key (0: none)."""
        self.codec: Codec = codec if codec is not None else JsonCodec()
        self.max_body_size = max_body_size
        self.grace_period = grace_period
        self.types = TypeRegistry()
        self.handlers = Handlers(container)
        self.handlers.provide(App, lambda context: context.app)
        self.handlers.provide(MessageContext, lambda context: context)
        self.incoming = incoming_pipeline(
            RetryStep(self.retry), self.codec, self.types, self.handlers, self.clock, max_body_size
        )
        self.outgoing = outgoing_pipeline(
            self.types, name, self.codec, lambda: self._transport, replies=consume
        )
        self._routes: dict[type, str] = {}
        self._subscriptions: list[type] = []
        self._sagas: list[SagaSpec] = []
        self._saga_runners: dict[str, SagaRunner] = {}
        self._memory_sagas = MemorySagaStore()
        self._worker: Worker | None = None
        self._running = False
        self._stopping: asyncio.Future[None] | None = None
        self._starting: asyncio.Task[Any] | None = None  # the task in start(), while it runs
        self._start_ended: asyncio.Event | None = None
        self._waiting: tuple[asyncio.Task[Any], asyncio.Event] | None = None  # start(wait=...)
        self._replies: _Replies | None = None
        self.storage: Storage | None = None
        self.telemetry: Telemetry | None = None  # set by mersal.telemetry.instrument
        self.settler = Settler(self.transport, self.retry.error_queue)
        self.log_messages = False
        """Log an INFO line per handled message (`mersal.handled`; `mersal run --log-messages`)."""

    def __repr__(self) -> str:
        return f"<App {self.name!r} on {mask(self.transport.address)}>"

    def set_concurrency(self, concurrency: int) -> None:
        """Handle up to `concurrency` messages at once (before start); the prefetch follows."""
        self._check_not_running("change the concurrency")
        check_concurrency(concurrency)
        self.concurrency = concurrency
        self.prefetch = check_prefetch(None, concurrency)

    @property
    def subscriptions(self) -> list[type]:
        """The event types the app subscribed to, in order."""
        return list(self._subscriptions)

    @property
    def transport(self) -> Transport:
        """What carries the app's messages (set it before the app starts to use another)."""
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self._check_not_running("change the transport")
        self._transport = transport

    @property
    def limits(self) -> Limits:
        """What the transport carries (a broker's are known once it is connected)."""
        return limits_of(self._transport)

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
        self.types.add(message_type)
        self.handlers.add(message_type, handler)

    def route(self, message_type: type, queue: str) -> None:
        """Send messages of `message_type` (and its subclasses) to `queue`."""
        self._check_not_running("route message types")
        check_message_class(message_type, self.codec, "route")
        check_queue_name(queue, f"route({message_type.__qualname__}, queue)")
        self.types.add(message_type)
        self._routes[message_type] = queue

    def subscribe(self, message_type: type) -> None:
        """Receive every published `message_type` in this app's queue."""
        self._check_not_running("subscribe")
        check_message_class(message_type, self.codec, "subscribe", bases=False)
        check_subscriptions(self._sagas, [message_type])
        self.types.add(message_type)
        if message_type not in self._subscriptions:
            self._subscriptions.append(message_type)

    def register_saga(self, saga: type[Saga[Any]], *, pessimistic: bool = False) -> None:
        """Run a saga: each message type it takes finds (or starts) its saga instance.

        Optimistic by default (a revision check at save; a conflict reruns the message at
        once); `pessimistic` locks the saga's row while the message is handled (FOR UPDATE).
        """
        self._check_not_running("register sagas")
        spec = saga_spec(saga, self.codec, pessimistic=pessimistic)
        for other in self._sagas:
            if other.name == spec.name:
                raise ConfigurationError(
                    f"{saga.__qualname__} and {other.cls.__qualname__} are both saga "
                    f"{spec.name!r}: give one another name (`class ...(Saga[D], name='...')`)"
                )
        for message_type in spec.methods:
            check_message_class(message_type, self.codec, "register_saga")
        check_subscriptions([spec], self._subscriptions)
        build = self.handlers.builder(saga)
        runner = SagaRunner(spec, build, self.saga_store, self.codec, self._saga_runners)
        self._saga_runners[spec.name] = runner

        async def run(message: Any, context: MessageContext) -> None:
            await runner(message, context)

        run.__qualname__ = saga.__qualname__
        for message_type in spec.methods:
            self.types.add(message_type)
            self.handlers.add(message_type, run)
        self._sagas.append(spec)

    @property
    def sagas(self) -> list[type[Saga[Any]]]:
        """The saga classes registered with `register_saga`."""
        return [spec.cls for spec in self._sagas]

    def saga_spec(self, saga: type[Saga[Any]]) -> SagaSpec:
        """The registration of a saga class; a ConfigurationError if it is not registered."""
        for spec in self._sagas:
            if spec.cls is saga:
                return spec
        raise ConfigurationError(
            f"{getattr(saga, '__qualname__', saga)} is not a saga of app {self.name!r}: "
            "app.register_saga(...) it first"
        )

    def saga_store(self) -> SagaStore:
        """Where this app's sagas live: its database's saga table, or this process's memory."""
        if self.storage is None:
            return self._memory_sagas
        store: SagaStore | None = getattr(self.storage, "sagas", None)
        if store is None:
            raise ConfigurationError(
                f"the storage of app {self.name!r} ({type(self.storage).__qualname__}) keeps no "
                "sagas: use mersal_sqlalchemy's, or drop the register_saga calls"
            )
        return store

    async def saga_data(self, saga: type[Saga[D]], correlation: object) -> D | None:
        """The committed data of the saga with this correlation value, or None if none runs."""
        return await saga_data(self, saga, correlation)

    def use_storage(self, storage: Storage) -> None:
        """Plug in an outbox and inbox (a storage adapter calls this): its steps join `incoming`."""
        self._check_not_running("attach a storage")
        if self.storage is not None:
            raise ConfigurationError(f"app {self.name!r} already has a storage attached")
        add_storage_steps(self.incoming, storage)
        self.storage = storage

    # Sending.

    async def send(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Send a command to the queue its type is routed to; returns the message id."""
        check_sendable(message, self.codec)
        return await self._emit(
            message, self.queue_for(type(message)), False, headers, partition_key
        )

    async def send_local(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Send a message to this app's own queue; returns the message id."""
        check_sendable(message, self.codec)
        self._check_own_queue("send_local()")
        return await self._emit(message, self.name, False, headers, partition_key)

    async def publish(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Publish an event to every app subscribed to its type; returns the message id."""
        check_sendable(message, self.codec)
        topic = self.types.name_of(type(message))
        return await self._emit(message, topic, True, headers, partition_key)

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
        check_sendable(message, self.codec)
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        limit = self.limits.max_delay
        if not math.isfinite(seconds) or seconds > limit:
            raise Unsendable(
                f"defer({delay!r}, ...) needs a finite delay of at most {limit:.0f}s, the longest "
                "the transport can hold a message"
            )
        merged = check_headers(headers)
        merged[Header.DELIVER_AT] = f"{time.time() + max(0.0, seconds):.6f}"
        queue = None if to_self else self._routes_get(type(message))
        if queue is None:
            what = "to itself" if to_self else "that has no route"
            self._check_own_queue(f"defer() a {type(message).__qualname__} {what}")
            queue = self.name
        return await self._emit(message, queue, False, merged, partition_key)

    async def reply(
        self,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
        partition_key: str | None = None,
    ) -> str:
        """Inside a handler: send `message` to the reply address of the message being handled."""
        check_sendable(message, self.codec)
        incoming = current_message.get()
        if incoming is None or incoming.app is not self:
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
        return await self._emit(message, reply_to, False, merged, partition_key)

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
        check_sendable(message, self.codec)
        if reply_type is not None:
            self.types.add(reply_type)
        replies = await self._reply_queue()
        message_id = new_id()
        merged = check_headers(headers)
        merged[Header.MESSAGE_ID] = message_id
        merged[Header.REPLY_TO] = replies.queue
        merged[Header.TEMPORARY_REPLY_TO] = "true"
        waiter = replies.expect(message_id)
        try:
            await self._emit(
                message, self.queue_for(type(message)), False, merged, partition_key, direct=True
            )
            async with asyncio.timeout(timeout):
                reply = await waiter
        except TimeoutError:
            raise RequestTimeout(
                f"no reply to {type(message).__qualname__} {message_id} within {timeout:g}s"
            ) from None
        finally:
            replies.forget(message_id)
        if reply_type is not None and not isinstance(reply, reply_type):
            raise UnexpectedReply(
                f"the reply to {type(message).__qualname__} {message_id} is a "
                f"{type(reply).__qualname__}, not the {reply_type.__qualname__} asked for"
            )
        return reply

    @asynccontextmanager
    async def transaction(self, session: object = None) -> AsyncIterator[Transaction]:
        """Buffer every send in the block; they leave on a clean exit, never after an error.

        With a database, the sends become outbox rows in `session`'s transaction (or in a
        session of the app's own when none is given), committed at the end of the block.
        Inside a handler (or another block) it joins the transaction already there: the sends
        leave with the message's, and if the block raises, the whole attempt fails.
        """
        self._check_running()
        current = current_transaction.get()
        if current is not None and current.owner is self:
            if not current.open:  # a task left behind by an attempt or a block that has ended
                raise TransactionClosed(
                    "this code runs in a transaction that has ended (a task the handler or "
                    "block left behind): send from inside the handler or block"
                )
            async with _joined(current, session) as joined:
                yield joined
            return
        if self.storage is not None:
            manager = self.storage.transaction(session)
        elif session is not None:
            raise ConfigurationError(
                "app.transaction(session) writes to the outbox, which needs App(database=...)"
            )
        else:
            manager = _buffered(self)
        async with manager as transaction:
            token = current_transaction.set(transaction)
            try:
                yield transaction
            finally:
                current_transaction.reset(token)

    async def send_committed(self, outgoing: Sequence[Outgoing]) -> None:
        """Hand a committed transaction's messages to the transport (without an outbox).

        Every message is tried; the first failure is raised. A reply whose requester's temporary
        queue is gone is dropped (logged): it has no one to reach.
        """
        if outgoing:
            results = await self.transport.send_each(outgoing)
            for sent, result in zip(outgoing, results, strict=True):
                if result is not None and not unreachable_reply(sent, result):
                    raise result

    def queue_for(self, message_type: type) -> str:
        """The queue `send` uses for a message type; a `ConfigurationError` if it has none."""
        queue = self._routes_get(message_type)
        if queue is None:
            raise ConfigurationError(
                f"{message_type.__qualname__} has no route: call "
                f"app.route({message_type.__qualname__}, 'queue-name') before sending it"
            )
        return queue

    def _routes_get(self, message_type: type) -> str | None:
        for cls in message_type.__mro__:
            queue = self._routes.get(cls)
            if queue is not None:
                return queue
        return None

    async def _emit(
        self,
        message: object,
        address: str,
        publish: bool,
        headers: Mapping[str, str] | None,
        partition_key: str | None,
        *,
        direct: bool = False,
    ) -> str:
        self._check_running()
        merged = check_headers(headers) if headers else {}
        if partition_key is not None:
            merged[Header.PARTITION_KEY] = partition_key_text(partition_key)
        incoming = current_message.get()
        if incoming is not None and incoming.app is not self:
            incoming = None
        transaction: Transaction | None = None
        if not direct:
            transaction = current_transaction.get()
            if transaction is not None and transaction.owner is not self:
                transaction = None
        context = OutgoingContext(message, address, publish, merged, incoming, transaction)
        await self.outgoing.run(context)
        return context.headers[Header.MESSAGE_ID]

    # Lifecycle.

    @property
    def running(self) -> bool:
        """Whether the app has started and not yet stopped."""
        return self._running

    @property
    def healthy(self) -> bool:
        """Running, still receiving, and no outbox row parked for an operator to deal with."""
        return (
            self._running
            and (not self.consume or (self._worker is not None and self._worker.failed is None))
            and (self.storage is None or not self.storage.parked)
        )

    def health(self, *, max_relay_lag: float = MAX_RELAY_LAG) -> Health:
        """Whether the app is alive and ready, and why not (see `mersal.health`); no I/O."""
        return check(self, max_relay_lag)

    @property
    def worker(self) -> Worker | None:
        """The worker pulling the app's deliveries, while it runs."""
        return self._worker

    @property
    def in_flight(self) -> int:
        """How many deliveries the worker is handling now."""
        return self._worker.in_flight if self._worker is not None else 0

    async def start(self, *, wait: float = 0.0) -> None:
        """Declare the queues, bind the subscriptions and start the worker.

        `wait`: seconds to keep trying while the broker or the database does not answer (as
        `mersal run --wait` does, each try logged), for an app started inside a web server's
        lifespan; 0 fails at the first `Unreachable`. Cancel the awaiting task, or call `stop()`,
        to stop waiting.
        """
        if self._running:
            return
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0:
            raise ConfigurationError(
                f"start(wait={wait!r}) must be a number of seconds >= 0 (0: do not wait)"
            )
        if wait > 0:
            await self._start_waiting(wait)
            return
        if self.database is not None and self.storage is None:
            storage = attach_storage(self)  # before the check: it provides AsyncSession
            if self.storage is None:  # the adapter's factory may have plugged it in itself
                self.use_storage(storage)
        self._check_configuration()
        self.incoming.freeze()
        self.outgoing.freeze()
        transport = self.transport
        self.settler = Settler(transport, self.retry.error_queue)
        self._starting, self._start_ended = asyncio.current_task(), asyncio.Event()
        try:
            await self._connect(transport)
        finally:
            self._starting = None
            self._start_ended.set()
        self._running = True
        if self._worker is not None:
            self._worker.start()
            self._warn_undelivered()
            self._warn_unhandled()
        log.info(
            "app %r started on %s%s",
            self.name,
            mask(transport.address),
            "" if self.consume else " (send-only)",
        )

    async def _start_waiting(self, wait: float) -> None:
        """Start within `wait` seconds of tries; a `stop()` meanwhile cancels this task."""
        task = asyncio.current_task()
        assert task is not None
        waiting = self._waiting = (task, asyncio.Event())
        try:
            await start_when_reachable(self, wait, hint="start(wait=SECONDS)", log=log)
        finally:
            self._waiting = None
            waiting[1].set()

    async def _connect(self, transport: Transport) -> None:
        """Start the transport, declare and bind, start the storage, open the consumer."""
        await transport.start()
        try:
            if self.consume:
                await self._declare_input(transport)
                await declare_error_queue(transport, self.retry.error_queue)
                await self._bind_subscriptions(transport)
            if self.storage is not None:
                await self.storage.start()
            if self.consume:
                consumer = await transport.consume(self.name, prefetch=self.prefetch)
                self._worker = Worker(
                    consumer, self._handle, self.settler, concurrency=self.concurrency
                )
        except BaseException:
            self._worker = None
            if self.storage is not None:
                await self.storage.stop()
            await transport.stop()
            raise

    async def _bind_subscriptions(self, transport: Transport) -> None:
        """Bind the input queue to each subscribed topic, and unbind it from any other."""
        topics = [self.types.name_of(message_type) for message_type in self._subscriptions]
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
        try:
            await asyncio.shield(self._stopping)
        finally:
            if self._stopping.done():
                self._stopping = None

    async def _abort_start(self) -> None:
        """Cancel a start() under way in another task, and wait until it has undone its work."""
        starting, ended = self._waiting or (self._starting, self._start_ended)
        if starting is None or ended is None or starting is asyncio.current_task():
            return
        starting.cancel()
        await ended.wait()

    async def _shut_down(self) -> None:
        began = time.monotonic()
        if log.isEnabledFor(logging.INFO):  # it may count the outbox's rows: only when shown
            log.info("%s", await waiting.stopping(self))
        unfinished = 0
        if self._worker is not None:
            unfinished = await self._worker.stop(self.grace_period)
        self._worker = None
        await self.clock.stop()
        self._running = False
        if self.storage is not None:
            await self.storage.stop()
        if self._replies is not None:
            await self._replies.close()
            self._replies = None
        await self.transport.stop()
        ended = waiting.stopped(self, time.monotonic() - began, unfinished)
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

    def _handle(self, delivery: Delivery) -> Awaitable[Outcome]:
        """Run the incoming pipeline; whatever happens, say how to settle the delivery."""
        unsent = self.settler.unsent(delivery)
        if unsent is not None:  # handled before; its retry or dead letter is what is left
            return _settled(unsent)
        context = MessageContext(self, delivery)
        return self._run_logged(context) if self.log_messages else self._run(context)

    async def _run_logged(self, context: MessageContext) -> Outcome:
        started = time.perf_counter()
        outcome = await self._run(context)
        log_handled(context, outcome, started)
        return outcome

    async def _run(self, context: MessageContext) -> Outcome:
        try:
            await self.incoming.run(context)
        except asyncio.CancelledError as error:
            if cancelled_by_owner():
                raise
            absorb_cancellation()
            return self._escaped(context, error)
        except BaseException as error:
            return self._escaped(context, error)
        if context.outcome is None:
            outcome = Outcome.dead_letter(STOPPED_SHORT, attempts_made(context.envelope) + 1)
            log_failure(context, outcome, outcome.attempts)
            return outcome
        return context.outcome

    def _escaped(self, context: MessageContext, error: BaseException) -> Outcome:
        """A failure outside the retry step: one attempt, then the policy's next stage."""
        made = attempts_made(context.envelope) + 1
        outcome = after_failure(self.retry, error, made, immediate=False)
        assert outcome is not None
        log_failure(context, outcome, made)
        return outcome

    async def _declare_input(self, transport: Transport) -> None:
        """Declare the app's queue, and its partitions if it has any."""
        if not self.partitions:
            await transport.declare(self.name)
            return
        try:
            await transport.declare(self.name, partitions=self.partitions)
        except TypeError as error:
            if "partitions" not in str(error):
                raise
            raise ConfigurationError(
                f"App(partitions={self.partitions}) needs a transport that partitions queues; "
                f"{mask(transport.address)} does not: use RabbitMQ, or leave partitions out"
            ) from None

    def _check_configuration(self) -> None:
        longest = max(self.retry.delayed, default=0.0)
        limit = limits_of(self.transport).max_delay
        if longest > limit:
            raise ConfigurationError(
                f"RetryPolicy(delayed=[..., {longest:g}, ...]) waits longer than the {limit:.0f}s "
                f"the transport {mask(self.transport.address)} can hold a message: use shorter "
                "delays"
            )
        if not self.consume:
            self._check_send_only()
        for message_type in self._subscriptions:
            if not self.handlers.has_handler(message_type):
                raise ConfigurationError(
                    f"app {self.name!r} subscribes to {message_type.__qualname__} but has no "
                    f"handler for it: app.register({message_type.__qualname__}, handler)"
                )
        if "commit" not in self.incoming.names:
            raise ConfigurationError(
                "app.incoming has no 'commit' step, so what handlers send (and, with a database, "
                "what they write) would never be committed: put it back, or replace it with a "
                "step that awaits context.transaction.commit()"
            )
        self.handlers.check()
        if self._sagas:
            self.saga_store()
            check_subscriptions(self._sagas, self._subscriptions)

    def _warn_unhandled(self) -> None:
        """Warn of types routed to this app's own queue that no handler here takes."""
        handled = self.handlers.message_types
        for message_type, queue in self._routes.items():
            if queue != self.name or self.handlers.has_handler(message_type):
                continue
            if any(issubclass(h, message_type) for h in handled):
                continue  # its subclasses are handled: the route is theirs
            name = message_type.__qualname__
            log.warning(
                "app %r routes %s to its own queue but has no handler for it: every %s it "
                "receives is dead-lettered (NoHandler); app.register(%s, handler), or route %s "
                "to the app that handles it",
                self.name,
                name,
                name,
                name,
                name,
            )

    def _check_own_queue(self, what: str) -> None:
        """Refuse `what` (a send to the app's own queue) in a send-only app, which has none."""
        if not self.consume:
            raise ConfigurationError(
                f"app {self.name!r} is send-only (consume=False) and has no queue of its own, so "
                f"it cannot {what}: route the type to the app that handles it (app.route)"
            )

    def _check_send_only(self) -> None:
        """A send-only app receives nothing: refuse what would wait for a delivery."""
        received = [*self._subscriptions, *self.handlers.message_types]
        if received:
            name = received[0].__qualname__
            raise ConfigurationError(
                f"app {self.name!r} is send-only (consume=False) and receives nothing, yet it "
                f"subscribes to or handles {name}: drop the subscribe/register calls, or let it "
                "consume (App(consume=True), the default)"
            )
        routed_home = [t for t, queue in self._routes.items() if queue == self.name]
        if routed_home:
            raise ConfigurationError(
                f"app {self.name!r} is send-only (consume=False), so it has no queue of its own, "
                f"yet it routes {routed_home[0].__qualname__} to {self.name!r}: route it to the "
                "app that handles it"
            )

    def _warn_undelivered(self) -> None:
        """Warn of handled types that no route to this app's queue or subscription brings."""
        home = [t for t, queue in self._routes.items() if queue == self.name]
        home += [t for spec in self._sagas for t in spec.timeouts]
        for handled in self.handlers.message_types:
            if any(issubclass(t, handled) for t in self._subscriptions) or any(
                issubclass(t, handled) or issubclass(handled, t) for t in home
            ):
                continue
            name = handled.__qualname__
            log.warning(
                "app %r handles %s but neither routes it to its own queue nor subscribes to it: "
                "its handler runs only for a %s sent with send_local, routed here by another "
                "app or replied to this app; app.route(%s, %r) if this app receives it, "
                "app.subscribe(%s) if it is a published event",
                self.name,
                name,
                name,
                name,
                self.name,
                name,
            )

    def _check_running(self) -> None:
        if not self._running:
            raise NotRunning(
                f"app {self.name!r} is not running: `await app.start()` or `async with app:` first"
            )

    def _check_not_running(self, what: str) -> None:
        if self._running:
            raise ConfigurationError(f"{what} before app {self.name!r} starts")

    async def _reply_queue(self) -> _Replies:
        self._check_running()
        if self._replies is None:
            queue = f"{self.name}.replies.{uuid.uuid4().hex[:12]}"
            await self.transport.declare(queue, temporary=True)
            consumer = await self.transport.consume(queue, prefetch=self.concurrency)
            self._replies = _Replies(self, queue, consumer)
        return self._replies


class _Replies:
    """The app instance's own reply queue and the requests waiting on it."""

    def __init__(self, app: App, queue: str, consumer: Consumer) -> None:
        self.app = app
        self.queue = queue
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        self._worker = Worker(consumer, self._handle, app.settler, concurrency=1)
        self._worker.start()

    def expect(self, message_id: str) -> asyncio.Future[Any]:
        """A future that the reply caused by `message_id` resolves."""
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = waiter
        return waiter

    def forget(self, message_id: str) -> None:
        """Stop waiting for a reply to `message_id`."""
        self._waiting.pop(message_id, None)

    async def close(self) -> None:
        """Fail the waiting requests at once, then stop receiving replies."""
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(NotRunning(f"app {self.app.name!r} stopped"))
        await self._worker.stop(grace=0.0)

    async def _handle(self, delivery: Delivery) -> Outcome:
        envelope = delivery.envelope
        waiter = self._waiting.get(envelope.headers.get(Header.CAUSATION_ID, ""))
        if waiter is None or waiter.done():
            log.warning("dropping a reply nobody waits for (late?): %s", describe(envelope.headers))
            return ACK
        try:
            cls = self.app.types.resolve(envelope.headers.get(Header.TYPE, ""))
            reply = self.app.codec.decode(envelope.body, cls)
        except asyncio.CancelledError as cancelled:  # raised by the reply's class, or a stop
            if cancelled_by_owner():
                raise
            absorb_cancellation()
            error: BaseException = cancelled
        except BaseException as failed:  # the reply's class may raise anything
            error = failed
        else:
            waiter.set_result(reply)
            return ACK
        failure = Failure.of(error)
        waiter.set_exception(DecodeError(f"the reply could not be decoded: {failure}"))
        log.error("a reply could not be decoded (%s): %s", failure, describe(envelope.headers))
        return Outcome.dead_letter(failure, 1)


def _is_handler(thing: object) -> bool:
    """Whether `thing` looks like a handler: a function, or a class or object with a
    `__call__` of its own (a message class has neither)."""
    call = getattr(thing, "__call__", None)  # noqa: B004
    return inspect.isfunction(thing) or inspect.isfunction(call) or inspect.ismethod(call)


def _handler_name(handler: object) -> str:
    """How a handler is written in a call: its name, or its class's for an object."""
    name = getattr(handler, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(handler).__qualname__}(...)"


async def _settled(outcome: Outcome) -> Outcome:
    return outcome


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
async def _buffered(app: App) -> AsyncIterator[Transaction]:
    transaction = Transaction(app.send_committed, app)
    try:
        yield transaction
    except BaseException:
        transaction.rollback()
        raise
    await transaction.commit()


def check_concurrency(concurrency: int) -> None:
    """Fail with a `ConfigurationError` unless `concurrency` is an int >= 1."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigurationError(f"App(concurrency={concurrency!r}) must be an int >= 1")


def check_partitions(partitions: int | None, consume: bool) -> int:
    """The number of partitions, 0 for none; a `ConfigurationError` for what cannot be."""
    if partitions is None:
        return 0
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ConfigurationError(
            f"App(partitions={partitions!r}) must be an int from 1 to {MAX_PARTITIONS}"
        )
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigurationError(
            f"App(partitions={partitions!r}) must be from 1 to {MAX_PARTITIONS}"
        )
    if not consume:
        raise ConfigurationError(
            "App(partitions=...) splits the app's own queue, and a send-only app "
            "(consume=False) has none: leave partitions out"
        )
    return partitions


def check_prefetch(prefetch: int | None, concurrency: int) -> int:
    """The deliveries an app takes at once: handled, or waiting behind their partition key."""
    if prefetch is None:
        return min(MAX_PREFETCH, concurrency * (1 + WAITING_PER_SLOT))
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < concurrency:
        raise ConfigurationError(
            f"App(prefetch={prefetch!r}) must be an int >= concurrency ({concurrency})"
        )
    return min(prefetch, MAX_PREFETCH)


def check_timeout(timeout: float | None) -> float | None:
    """A handler timeout in seconds (None: none), or a `ConfigurationError`."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigurationError(
            f"App(handler_timeout={timeout!r}) must be a number of seconds > 0, or None"
        )
    return None if math.isinf(timeout) else float(timeout)


def check_queue_name(name: str, what: str) -> None:
    """Fail with a `ConfigurationError` unless `name` is a usable queue name."""
    if not isinstance(name, str) or not QUEUE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"{what} = {name!r} is not a usable queue name: use 1-200 letters, digits and "
            "'_', '.', ':', '/', '-', starting with a letter or digit"
        )
