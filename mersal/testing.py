"""A harness for users' tests: apps on a private memory broker, run until idle, then inspect."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from mersal.app import App
from mersal.errors import ConfigurationError, MersalError
from mersal.messages import Envelope, Header
from mersal.sagas import Saga
from mersal.transport import Outgoing, delay_of
from mersal.transport.memory import MemoryBroker, MemoryTransport
from mersal.waiting import pending_rows, plural, running_handlers, seconds, type_of, with_times

T = TypeVar("T")
D = TypeVar("D")


@dataclass(frozen=True)
class Recorded:
    """A message that left an app: where it went, its headers, and the decoded object."""

    address: str
    headers: dict[str, str]
    message: Any

    @property
    def message_id(self) -> str:
        """The recorded message's id."""
        return self.headers.get(Header.MESSAGE_ID, "")


@dataclass(frozen=True)
class DeadLetter(Recorded):
    """A message moved to an error queue, with why."""

    @property
    def error_type(self) -> str:
        """The qualified name of the exception that made it fail."""
        return self.headers.get(Header.ERROR_TYPE, "")

    @property
    def error_message(self) -> str:
        """The failure's message."""
        return self.headers.get(Header.ERROR_MESSAGE, "")

    @property
    def attempts(self) -> int:
        """How often it was handled before giving up."""
        return int(self.headers.get(Header.ERROR_ATTEMPTS, "0"))

    @property
    def source_queue(self) -> str:
        """The queue it failed in."""
        return self.headers.get(Header.ERROR_QUEUE, "")


SHOWN_DELAYED = 5
"""The most delayed messages `NotIdle` names one by one."""


class NotIdle(MersalError, TimeoutError):
    """`Harness.idle` timed out; the message says what the apps were still busy with."""


def _handler_waits(app: App, several: bool) -> list[str]:
    """The app's running handlers and the messages waiting behind their partition key."""
    in_app = f" in app {app.name!r}" if several else ""
    running = running_handlers(app.types, app.worker)
    waits = []
    if running:
        which = with_times(running)
        waits.append(f"{plural(len(running), 'handler')} running{in_app} for {which}")
    behind = app.in_flight - len(running)
    if behind > 0:
        waits.append(f"{plural(behind, 'message')}{in_app} waiting behind their partition key")
    return waits


class Harness:
    """Runs apps on one private memory broker and records every message that moves.

    >>> async with Harness(app) as bus:
    ...     await app.send(PlaceOrder("o-1", 9.5))
    ...     await bus.idle()
    ...     assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]
    """

    def __init__(self, *apps: App) -> None:
        if not apps:
            raise ConfigurationError("Harness(app, ...) needs at least one app")
        self.apps = apps
        self.sent: list[Recorded] = []
        self.published: list[Recorded] = []
        self.deferred: list[Recorded] = []
        self.retried: list[Recorded] = []
        self.dead_lettered: list[DeadLetter] = []
        self._url = f"memory://harness-{uuid.uuid4().hex}"
        self._error_queues = {app.retry.error_queue for app in apps}
        self._broker: MemoryBroker | None = None

    async def __aenter__(self) -> Harness:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Move every app onto the harness's memory broker and start them."""
        for app in self.apps:
            if app.running:
                raise ConfigurationError(f"hand app {app.name!r} to the Harness before starting it")
            app.transport = MemoryTransport(self._url)
        transport = self.apps[0].transport
        assert isinstance(transport, MemoryTransport)
        self._broker = transport.broker
        self._broker.observers.append(self._record)
        started: list[App] = []
        try:
            for app in self.apps:
                await app.start()
                started.append(app)
        except BaseException:
            for app in reversed(started):
                await app.stop()
            self._broker.observers.remove(self._record)
            raise

    async def stop(self) -> None:
        """Stop every app."""
        try:
            for app in reversed(self.apps):
                await app.stop()
        finally:
            if self._broker is not None and self._record in self._broker.observers:
                self._broker.observers.remove(self._record)

    @property
    def broker(self) -> MemoryBroker:
        """The memory broker the apps share."""
        if self._broker is None:
            raise MersalError("start the Harness first")
        return self._broker

    async def idle(self, timeout: float = 5.0, *, include_delayed: bool = True) -> None:
        """Wait until no message is queued, in flight, in an outbox or (optionally) delayed.

        After `timeout` seconds, raises `NotIdle` (a TimeoutError) naming what it still waits for.
        """
        broker = self.broker
        try:
            async with asyncio.timeout(timeout):
                calm = 0
                while calm < 3:
                    quiet = (
                        all(queue.idle for queue in broker.queues.values())
                        and (not include_delayed or not broker.delayed)
                        and all(app.in_flight == 0 for app in self.apps)
                        and await self._outboxes_empty()
                    )
                    calm = calm + 1 if quiet else 0
                    await asyncio.sleep(0 if calm else 0.001)
        except TimeoutError:
            waits = await self._still_waiting(include_delayed) or [
                "nothing any more (it settled as the time ran out)"
            ]
            raise NotIdle(
                f"Harness.idle(timeout={timeout:g}): still waiting after {timeout:g} s for: "
                + "; ".join(waits)
            ) from None

    async def _still_waiting(self, include_delayed: bool) -> list[str]:
        """What keeps the apps from being idle, one phrase each."""
        waits = self._delayed_waits() if include_delayed else []
        several = len(self.apps) > 1
        for app in self.apps:
            waits += _handler_waits(app, several)
        for name, queue in self.broker.queues.items():
            if queue.ready and queue.consumers:
                waits.append(f"{plural(len(queue), 'message')} queued in {name!r}, not yet taken")
        for app in self.apps:
            pending = await pending_rows(app.storage)
            if pending:
                waits.append(f"{plural(pending, 'outbox row')} of app {app.name!r} not yet sent")
        return waits

    def _delayed_waits(self) -> list[str]:
        waiting = self.broker.waiting()
        waits = [
            f"{self._delayed(envelope)} due in {seconds(max(0.0, due))}"
            for _, envelope, due in waiting[:SHOWN_DELAYED]
        ]
        if len(waiting) > SHOWN_DELAYED:
            waits.append(f"{len(waiting) - SHOWN_DELAYED} more delayed message(s)")
        return waits

    def _delayed(self, envelope: Envelope) -> str:
        """`a delayed retry of Ping (attempt 2)`, `a timeout of saga 'checkout' (Expire)`..."""
        headers = envelope.headers
        name = self._type_name(envelope)
        if Header.SAGA_TYPE in headers:
            return f"a timeout of saga {headers[Header.SAGA_TYPE]!r} ({name})"
        attempts = headers.get(Header.ATTEMPT, "")
        if attempts.isdigit():
            return f"a delayed retry of {name} (attempt {int(attempts) + 1})"
        return f"a deferred {name}"

    def _type_name(self, envelope: Envelope) -> str:
        for app in self.apps:
            if app.types.known(envelope.headers.get(Header.TYPE, "")) is not None:
                return type_of(app.types, envelope)
        return type_of(self.apps[0].types, envelope)

    def deliver_delayed(self, within: float | None = None) -> int:
        """Deliver deferred messages and timeouts due within `within` seconds now (None: all)."""
        return self.broker.deliver_delayed(within)

    async def saga_data(self, saga: type[Saga[D]], correlation: object) -> D | None:
        """The committed data of the saga with this correlation value, in whichever app runs it."""
        for app in self.apps:
            if saga in app.sagas.classes:
                return await app.saga_data(saga, correlation)
        raise ConfigurationError(
            f"no app of this Harness runs saga {getattr(saga, '__qualname__', saga)}: "
            "app.register_saga(...) it"
        )

    async def _outboxes_empty(self) -> bool:
        for app in self.apps:
            if app.storage is not None and await app.storage.pending():
                return False
        return True

    def sent_of(self, message_type: type[T]) -> list[T]:
        """The messages of this type that were sent, as objects, in order."""
        return [r.message for r in self.sent if isinstance(r.message, message_type)]

    def published_of(self, message_type: type[T]) -> list[T]:
        """The messages of this type that were published, as objects, in order."""
        return [r.message for r in self.published if isinstance(r.message, message_type)]

    def dead_lettered_of(self, message_type: type[T]) -> list[T]:
        """The messages of this type that reached an error queue, as objects, in order."""
        return [r.message for r in self.dead_lettered if isinstance(r.message, message_type)]

    def _record(self, outgoing: Outgoing) -> None:
        envelope = outgoing.envelope
        headers = dict(envelope.headers)
        message = self._decode(envelope)
        if Header.ERROR_TYPE in headers and outgoing.address in self._error_queues:
            self.dead_lettered.append(DeadLetter(outgoing.address, headers, message))
        elif outgoing.publish:
            self.published.append(Recorded(outgoing.address, headers, message))
        elif Header.ATTEMPT in headers:
            self.retried.append(Recorded(outgoing.address, headers, message))
        elif delay_of(envelope) > 0:
            self.deferred.append(Recorded(outgoing.address, headers, message))
        else:
            self.sent.append(Recorded(outgoing.address, headers, message))

    def _decode(self, envelope: Envelope) -> Any:
        name = envelope.headers.get(Header.TYPE, "")
        for app in self.apps:
            try:
                return app.codec.decode(envelope.body, app.types.resolve(name))
            except BaseException:  # whatever the class raises while being built: keep the bytes
                continue
        return envelope.body
