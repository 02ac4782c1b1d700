"""The two kinds of channel on Mersal's connection, and what brings each back.

A plain channel (publishing, declaring, looking) is never restored: its owner opens a new one
when it finds it closed. A restored channel (each consumer's) is aio-pika's robust channel,
which remembers its QoS, the queues looked up on it and its consumers (their tags and
arguments), and reopens with all of them: by itself when the broker closed the channel alone,
and when its consumer calls `restore()` after a reconnect. `RestoredChannel` adds what Mersal
needs of every underlying channel that aio-pika opens for it: the guard of `patches`, and an
ear for the broker's cancels of its consumers, which aio-pika does not consume again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection

from mersal_rabbitmq import patches

log = logging.getLogger("mersal.rabbitmq")

Cancelled = Callable[[str], None]
"""Hears the tag of a consumer that the broker cancelled (its queue was deleted)."""


class RestoredChannel(aio_pika.RobustChannel):
    """aio-pika's robust channel, each underlying channel guarded and heard for cancels."""

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
