"""Request and reply: `app.request` sends a command and awaits its reply on a queue of its own.

An app instance's first request declares a temporary reply queue and consumes it. Each reply
names the request it answers (its causation id) and resolves that request's future. Replies go
through a `Receiver` like the app's own deliveries, with one step: a reply that cannot be
decoded fails its request and is dead-lettered; one nobody waits for any more is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from mersal.context import MessageContext
from mersal.errors import (
    ConfigurationError,
    DecodeError,
    NotRunning,
    RequestTimeout,
    UnexpectedReply,
)
from mersal.messages import Header, TypeRegistry, check_sendable, describe, new_id
from mersal.numbers import is_seconds
from mersal.pipeline import Next, Pipeline, check_headers, completed
from mersal.receiving import Receiver
from mersal.retry import RetryPolicy
from mersal.sending import Sender
from mersal.settings import Settings
from mersal.settle import Failure, Settler, cancelled_by_owner
from mersal.transaction import Transaction
from mersal.transport import Transport
from mersal.worker import Worker

log = logging.getLogger("mersal.requests")


class Requests:
    """An app's requests in flight and the reply queue their replies come to."""

    def __init__(self, app: Any, settings: Settings, types: TypeRegistry, sender: Sender) -> None:
        self.app = app
        self.settings = settings
        self.types = types
        self.sender = sender
        self.settler: Settler | None = None
        self._replies: Replies | None = None
        self._opening = asyncio.Lock()

    @property
    def replies(self) -> Replies | None:
        """The reply queue, once the first request opened it."""
        return self._replies

    def open(self, settler: Settler) -> None:
        """Settle replies through `settler` from now on (the app has started)."""
        self.settler = settler
        self._opening = asyncio.Lock()  # of this start's loop: a later start may run in another

    async def request(
        self,
        message: object,
        timeout: float,
        reply_type: type | None,
        headers: Mapping[str, str] | None,
        partition_key: str | None,
    ) -> Any:
        """Send a command now and wait for its reply (the replier calls `app.reply`)."""
        check_timeout(timeout)
        check_sendable(message, self.settings.codec)
        if reply_type is not None:
            self.types.add(reply_type)
        replies = await self._reply_queue()
        message_id = new_id()
        merged = check_headers(headers)
        merged[Header.MESSAGE_ID] = message_id
        merged[Header.REPLY_TO] = replies.queue
        merged[Header.TEMPORARY_REPLY_TO] = "true"
        waiter = replies.expect(message_id)
        name = type(message).__qualname__
        try:
            queue = self.sender.routes.queue_for(type(message))
            await self.sender.emit(message, queue, False, merged, partition_key, direct=True)
            async with asyncio.timeout(timeout):
                reply = await waiter
        except TimeoutError:
            raise RequestTimeout(f"no reply to {name} {message_id} within {timeout:g}s") from None
        finally:
            replies.forget(message_id)
        if reply_type is not None and not isinstance(reply, reply_type):
            raise UnexpectedReply(
                f"the reply to {name} {message_id} is a {type(reply).__qualname__}, not the "
                f"{reply_type.__qualname__} asked for"
            )
        return reply

    async def close(self) -> None:
        """Fail the requests still waiting, and stop receiving replies."""
        replies, self._replies = self._replies, None
        self.settler = None
        if replies is not None:
            await replies.close(NotRunning(f"app {self.settings.name!r} stopped"))

    async def _reply_queue(self) -> Replies:
        self.sender.check_running()
        async with self._opening:
            transport, settler = self.sender.transport, self.settler
            if self._replies is None and transport is not None and settler is not None:
                self._replies = await Replies.open(self, transport, settler)
        if self._replies is None:
            self.sender.check_running()  # stopped meanwhile: says so
            raise NotRunning(f"app {self.settings.name!r} is stopping")
        return self._replies


def check_timeout(timeout: object) -> None:
    """Refuse a request timeout that is not a number of seconds above 0."""
    if not is_seconds(timeout, zero=False):
        raise ConfigurationError(
            f"request(timeout={timeout!r}): give the seconds to wait for the reply, a number "
            "above 0 (30 by default)"
        )


class Replies:
    """An app instance's own reply queue and the requests waiting on it."""

    def __init__(self, requests: Requests, queue: str) -> None:
        self.requests = requests
        self.queue = queue
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.worker: Worker | None = None

    @classmethod
    async def open(cls, requests: Requests, transport: Transport, settler: Settler) -> Replies:
        """Declare a temporary queue and start receiving replies on it."""
        settings = requests.settings
        queue = f"{settings.name}.replies.{uuid.uuid4().hex[:12]}"
        await transport.declare(queue, temporary=True)
        consumer = await transport.consume(queue, prefetch=settings.concurrency)
        replies = cls(requests, queue)
        policy = RetryPolicy(immediate=0, delayed=(), error_queue=settler.error_queue)  # once
        pipeline = Pipeline([("reply", replies.resolve)], end=completed)
        receive = Receiver(requests.app, pipeline, policy, settler, _no_transaction)
        replies.worker = Worker(consumer, receive, settler, concurrency=1)
        replies.worker.start()
        return replies

    def expect(self, message_id: str) -> asyncio.Future[Any]:
        """A future that the reply caused by `message_id` resolves."""
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[message_id] = waiter
        return waiter

    def forget(self, message_id: str) -> None:
        """Stop waiting for a reply to `message_id`."""
        self.waiting.pop(message_id, None)

    async def close(self, error: Exception) -> None:
        """Fail the waiting requests with `error` at once, then stop receiving replies."""
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(error)
        if self.worker is not None:
            await self.worker.stop(grace=0.0)

    async def resolve(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """The reply step: decode the reply for its request, or fail the request and raise."""
        headers = context.headers
        waiter = self.waiting.get(headers.get(Header.CAUSATION_ID, ""))
        if waiter is None or waiter.done():
            log.warning("dropping a reply nobody waits for (late?): %s", describe(headers))
            await next(context)
            return
        requests = self.requests
        try:
            cls = requests.types.resolve(headers.get(Header.TYPE, ""))
            reply = requests.settings.codec.decode(context.envelope.body, cls)
        except BaseException as error:  # the reply's class may raise anything: dead-lettered
            if not (isinstance(error, asyncio.CancelledError) and cancelled_by_owner()):
                waiter.set_exception(
                    DecodeError(f"the reply could not be decoded: {Failure.of(error)}")
                )
            raise
        waiter.set_result(reply)
        await next(context)


def _no_transaction(envelope: object) -> Transaction:
    """Replies send nothing: their attempts' transactions have nothing to commit."""
    return Transaction(_refuse)


async def _refuse(transaction: Transaction) -> None:
    return None
