"""The two kinds of channel on Mersal's connection, and what brings each back.

A plain channel (publishing, declaring, looking) is never restored: its owner opens a new one
when it finds it closed. A restored channel (each consumer's) is aio-pika's robust channel,
which remembers its QoS, the queues looked up on it and its consumers (their tags and
arguments), and reopens with all of them: by itself when the broker closed the channel alone,
and when its consumer calls `restore()` after a reconnect. `RestoredChannel` adds what Mersal
needs of every underlying channel that aio-pika opens for it: the guard of `patches`, and an
ear for the broker's cancels of its consumers, which aio-pika does not consume again. Its
queues (`RestoredQueue`) hand each delivery to the consumer as aiormq read it: aio-pika's
`Queue.consume` would wrap every message in an `IncomingMessage` and a task of its own, a
tenth of the CPU a round trip costs, for nothing Mersal reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, ConsumerTag
from aiormq.abc import DeliveredMessage

from mersal_rabbitmq import patches

log = logging.getLogger("mersal.rabbitmq")

Cancelled = Callable[[str], None]
"""Hears the tag of a consumer that the broker cancelled (its queue was deleted)."""
Take = Callable[[DeliveredMessage], Coroutine[Any, Any, None]]
"""Takes each delivery of a consumer, as aiormq read it."""


class RestoredQueue(aio_pika.RobustQueue):
    """aio-pika's robust queue, whose consumers take aiormq's deliveries as they are."""

    async def consume(  # type: ignore[override]
        self,
        callback: Take,
        no_ack: bool = False,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        consumer_tag: ConsumerTag | None = None,
        timeout: float | None = None,
        robust: bool = True,
    ) -> ConsumerTag:
        """Consume the queue with `callback`; aio-pika consumes with it again on restoring."""
        underlay = await self.channel.get_underlay_channel()
        consuming = await underlay.basic_consume(
            queue=self.name,
            consumer_callback=callback,
            exclusive=exclusive,
            no_ack=no_ack,
            arguments=arguments,
            consumer_tag=consumer_tag,
            timeout=timeout,
        )
        tag = consuming.consumer_tag
        if tag is None:
            raise aiormq.exceptions.AMQPError(f"RabbitMQ named no consumer tag for {self.name!r}")
        if robust:
            self._consumers[tag] = {
                "callback": callback,
                "no_ack": no_ack,
                "exclusive": exclusive,
                "arguments": arguments,
            }
        return tag


class RestoredChannel(aio_pika.RobustChannel):
    """aio-pika's robust channel, each underlying channel guarded and heard for cancels."""

    QUEUE_CLASS = RestoredQueue

    def __init__(self, connection: AbstractConnection, cancelled: Cancelled) -> None:
        super().__init__(connection, publisher_confirms=False)
        self._cancelled = cancelled
        self._heard: aiormq.abc.AbstractChannel | None = None

    async def get_underlay_channel(self) -> aiormq.abc.AbstractChannel:
        """The underlying channel; guarded, and heard for cancels, from the first use on."""
        underlay = await super().get_underlay_channel()
        if underlay is not self._heard:
            self._heard = underlay
            patches.guard_underlay(underlay)
            underlay.on_consumer_cancel_callbacks.add(self._on_cancel)
        return underlay

    async def existing_queue(self, name: str) -> RestoredQueue:
        """The queue `name`, looked up (not made): restored with the channel from now on."""
        queue = await self.declare_queue(name, passive=True)
        assert isinstance(queue, RestoredQueue)
        return queue

    def _on_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        self._cancelled(frame.consumer_tag or "")


async def close_quietly(channel: AbstractChannel) -> None:
    """Close a channel that is going away either way; a failure is only logged."""
    if not channel.is_initialized:  # a restored channel whose reopening failed: nothing open
        return
    try:
        await channel.close()
    except Exception as error:
        log.debug("closing a channel failed: %s", error)
