"""What AMQP 1.0 leaves to the broker: queues, bindings, wait queues, and the addresses to use.

AMQP 1.0 moves messages between addresses; it says nothing of how queues, bindings or
dead-lettering are made. Each broker does that its own way, so the transport asks a
`Topology`. On RabbitMQ 3.x (`RabbitMQ3Topology`), the 0-9-1 transport's topology does it
over a 0-9-1 connection of its own, and the addresses are those of the AMQP 1.0 plugin:
`/amq/queue/NAME` for an existing queue, `/exchange/NAME/KEY` for an exchange. RabbitMQ 4.x's
management node (`/management` over AMQP 1.0, addresses `/queues/NAME`) and brokers that
create queues on first use (Artemis, Azure Service Bus) are further implementations of the
same protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from functools import partial
from typing import Protocol

from mersal.errors import ConfigurationError, MersalError, OutcomeUnknown, Unroutable, Unsendable
from mersal.transport import Outgoing
from mersal.transport.limits import Limits
from mersal_rabbitmq import RabbitMQTransport

TEMPORARY_EXPIRES = 60.0
"""Seconds the broker keeps a temporary queue unused, when its transport never deleted it."""


class Topology(Protocol):
    """Queues, bindings and wait queues on one broker, and the AMQP 1.0 addresses to use."""

    limits: Limits

    async def start(self) -> None:
        """Connect to what makes the topology, and declare what sends go through."""
        ...

    async def stop(self) -> None:
        """Delete the temporary queues, disconnect."""
        ...

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Make sure `queue` exists (see `Transport.declare`)."""
        ...

    async def declare_error_queue(self, queue: str) -> None:
        """Make sure the error queue `queue` exists."""
        ...

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        ...

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Unbind `queue` from the topics it no longer subscribes to."""
        ...

    async def targets(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """For each message, the address to send it to, or why not (Unroutable: no queue)."""
        ...

    async def sources(self, queue: str) -> list[tuple[str, str]]:
        """(queue, address) of each queue that consuming `queue` takes from; Unroutable if none."""
        ...

    async def restore(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if they were declared here."""
        ...


class RabbitMQ3Topology:
    """RabbitMQ 3.x: the 0-9-1 transport's topology, the AMQP 1.0 plugin's addresses."""

    def __init__(self, url: str, *, queue_type: str | None = None) -> None:
        self.rabbitmq = RabbitMQTransport(
            url, queue_type=queue_type, shared_temporaries=TEMPORARY_EXPIRES
        )
        self.limits = Limits(max_delay=self.rabbitmq.limits.max_delay)
        self._checks: dict[str, Check] = {}  # queue -> whether it exists, asked once at a time

    async def start(self) -> None:
        """Connect over 0-9-1 and declare the events exchange."""
        await self.rabbitmq.start()
        self.limits = Limits(max_delay=self.rabbitmq.limits.max_delay)

    async def stop(self) -> None:
        """Delete the temporary queues and disconnect."""
        self._checks.clear()
        await self.rabbitmq.stop()

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Declare `queue` over 0-9-1 (a temporary one shared, so that AMQP 1.0 can consume it)."""
        _check_name(queue)
        await self.rabbitmq.declare(queue, temporary=temporary, partitions=partitions)

    async def declare_error_queue(self, queue: str) -> None:
        """Declare the error queue as the 0-9-1 transport does: a durable classic queue."""
        _check_name(queue)
        await self.rabbitmq.declare_error_queue(queue)

    async def bind(self, queue: str, topic: str) -> None:
        """Bind `queue` to `topic` on the events exchange."""
        await self.rabbitmq.bind(queue, topic)

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Unbind `queue` from the events exchange's topics not in `topics`."""
        await self.rabbitmq.prune_bindings(queue, topics)

    async def targets(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """`/exchange/E/KEY` through an exchange, `/amq/queue/Q` to a queue that exists.

        Each queue is checked once for all the messages, all queues at once.
        """
        routes: list[tuple[str, str] | Exception] = []
        for outgoing in messages:
            try:
                routes.append(await self.rabbitmq.route(outgoing))
            except MersalError as error:
                routes.append(error)
            except (ConnectionError, TimeoutError) as error:
                routes.append(OutcomeUnknown(f"no route for it ({error}): send it again"))
        queues = sorted({route[1] for route in routes if isinstance(route, tuple) and not route[0]})
        if len(queues) == 1:  # the common case needs no task
            found = [await self._missing(queues[0])]
        else:
            found = await asyncio.gather(*(self._missing(queue) for queue in queues))
        missing = {queue: problem for queue, problem in zip(queues, found, strict=True) if problem}
        return [_address(route, missing) for route in routes]

    async def _missing(self, queue: str) -> Exception | None:
        """Why nothing can be sent to `queue` (Unroutable: it does not exist), or None."""
        try:
            await self._check_exists(queue)
        except Exception as error:
            return error
        return None

    async def sources(self, queue: str) -> list[tuple[str, str]]:
        """The queue and its partitions, each at `/amq/queue/NAME`."""
        await self._check_exists(queue, consuming=True)
        return [(name, queue_address(name)) for name in await self.rabbitmq.consumed_queues(queue)]

    async def restore(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if this topology declared them."""
        await self.rabbitmq.restore_queue(queue)

    async def _check_exists(self, queue: str, *, consuming: bool = False) -> None:
        """Raise Unroutable unless `queue` exists: a send to a missing one is accepted and lost.

        Asked over 0-9-1 for every send, since a queue may be deleted at any time; sends that
        wait meanwhile share the next answer.
        """
        _check_name(queue)
        checking = self._checks.get(queue)
        if checking is None:
            checking = self._checks[queue] = Check(partial(self.rabbitmq.exists, queue))
        if await checking.result():
            return
        if consuming:
            raise Unroutable(f"no queue named {queue!r} to consume from: declare it first")
        raise Unroutable(
            f"no queue named {queue!r}: start the app that owns it, or check the route"
        )


class Check:
    """A question asked again for each caller, callers that ask meanwhile sharing one answer.

    Every answer comes from an asking that started after its caller asked (a queue deleted
    a moment ago is seen gone), and at most one asking runs at a time (many concurrent sends
    to a queue cost one check).
    """

    def __init__(self, ask: Callable[[], Awaitable[bool]]) -> None:
        self._ask = ask
        self._running: asyncio.Task[bool] | None = None
        self._next: asyncio.Future[bool] | None = None

    async def result(self) -> bool:
        """An answer from an asking that started after this call."""
        if self._running is None:
            self._running = asyncio.ensure_future(self._ask())
            self._running.add_done_callback(self._done)
            return await asyncio.shield(self._running)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._next)

    def _done(self, task: asyncio.Task[bool]) -> None:
        waiting, self._next, self._running = self._next, None, None
        if waiting is None:
            return
        self._running = asyncio.ensure_future(self._ask())
        self._running.add_done_callback(self._done)
        self._running.add_done_callback(partial(_pass_on, waiting))


def _pass_on(waiting: asyncio.Future[bool], task: asyncio.Task[bool]) -> None:
    if waiting.done():
        return
    if task.cancelled():
        waiting.cancel()
    elif (error := task.exception()) is not None:
        waiting.set_exception(error)
    else:
        waiting.set_result(task.result())


def _address(route: tuple[str, str] | Exception, missing: dict[str, Exception]) -> str | Exception:
    if isinstance(route, Exception):
        return route
    exchange, key = route
    if exchange:
        return f"/exchange/{exchange}/{key}"
    return missing.get(key) or queue_address(key)


def queue_address(queue: str) -> str:
    """The AMQP 1.0 plugin's address of an existing queue."""
    return f"/amq/queue/{queue}"


def _check_name(queue: str) -> None:
    if "/" in queue:
        raise ConfigurationError(
            f"queue name {queue!r} has a '/', which RabbitMQ's AMQP 1.0 addresses cannot carry: "
            "name it without one"
        )


class QueuesByName:
    """A broker that makes a queue at the first link to its name (Artemis, Qpid, Proton's example).

    Addresses are queue names, and nothing is declared: topics (`bind`, `publish`) and delays
    (which RabbitMQ's wait queues carry) need the broker's own way and are refused here.
    """

    def __init__(self) -> None:
        self.limits = Limits(max_delay=0.0)

    async def start(self) -> None:
        """Nothing to connect."""

    async def stop(self) -> None:
        """Nothing to disconnect."""

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Nothing to declare: the broker makes the queue when a link first names it."""
        if partitions:
            raise ConfigurationError(
                f"queue {queue!r} cannot have partitions on a broker without RabbitMQ's exchanges"
            )

    async def declare_error_queue(self, queue: str) -> None:
        """Nothing to declare."""

    async def bind(self, queue: str, topic: str) -> None:
        """Refused: there is no standard way to subscribe a queue to a topic over AMQP 1.0."""
        raise ConfigurationError(
            f"cannot subscribe queue {queue!r} to {topic!r}: this broker's topics are not known "
            "to the AMQP 1.0 transport (topology=queues); send to queues, or use RabbitMQ"
        )

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """No bindings are made, so none are pruned."""

    async def targets(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Each queue's name; an event is refused."""
        return [
            Unsendable(
                f"cannot publish {outgoing.address!r}: this broker's topics are not known to "
                "the AMQP 1.0 transport (topology=queues)"
            )
            if outgoing.publish
            else outgoing.address
            for outgoing in messages
        ]

    async def sources(self, queue: str) -> list[tuple[str, str]]:
        """The queue, by its name."""
        return [(queue, queue)]

    async def restore(self, queue: str) -> None:
        """Nothing to declare again."""
