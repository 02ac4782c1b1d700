"""Acks sent together: one `multiple` ack for every settled delivery at the head of a channel.

Acking each delivery on its own costs a frame and a socket write each. Here an ack is noted
and sent `delay` seconds later with the others noted meanwhile: the longest run of noted acks
at the head of the channel's unsettled deliveries (in delivery-tag order) goes as one ack
with `multiple=True`. An ack behind a delivery still being handled cannot be
covered by that; it waits `linger` seconds for the gap to close and is then sent on its own.

A delivery that is nacked stays unsettled here until its nack is written, so a multiple ack
never covers it. One writer per channel sends the acks in the order they were decided, so an
ack of one tag never lands behind the multiple ack that covered it. An ack not yet sent when
the channel closes is lost with the channel: the broker delivers that message again (the
inbox absorbs such a copy).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import aiormq

from mersal_rabbitmq.failures import why

log = logging.getLogger("mersal.rabbitmq")

DELAY = 0.002
"""Seconds an ack waits for others to go with it."""
LINGER = 0.02
"""Seconds an ack behind an unsettled delivery waits to join a multiple ack."""


class Acks:
    """The acks owed on one channel, noted by the app and sent in as few frames as possible."""

    def __init__(
        self, channel: aiormq.abc.AbstractChannel, delay: float = DELAY, linger: float = LINGER
    ) -> None:
        self.channel = channel
        """The channel whose deliveries these acks settle."""
        self._delay = delay
        self._linger = linger
        self._unsettled: deque[int] = deque()
        self._noted: set[int] = set()
        self._gone: set[int] = set()  # settled on their own, still in `_unsettled` until the head
        self._flush: asyncio.Handle | None = None
        self._queued: deque[tuple[int, bool]] = deque()
        self._writer: asyncio.Future[None] | None = None

    def received(self, tag: int) -> None:
        """A delivery arrived on the channel: it is unsettled until acked or nacked."""
        self._unsettled.append(tag)

    def ack(self, tag: int) -> None:
        """Ack the delivery, together with the others noted in the next `delay` seconds."""
        self._noted.add(tag)
        self._soon()

    def nacked(self, tag: int) -> None:
        """The delivery's nack was written: the acks behind it may go."""
        self._gone.add(tag)
        self._soon()

    def _soon(self) -> None:
        """Send the head `delay` seconds from now, unless a send is due already."""
        if self._noted and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._delay, self._send_head)

    async def drain(self) -> None:
        """Send every noted ack now; once this returns they are queued ahead of a close."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._send_head()
        self._send_rest()
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)

    def _send_head(self) -> None:
        self._flush = None
        unsettled, noted, gone = self._unsettled, self._noted, self._gone
        last = None
        while unsettled and (unsettled[0] in noted or unsettled[0] in gone):
            tag = unsettled.popleft()
            if tag in gone:  # settled already: a multiple ack past it leaves it alone
                gone.discard(tag)
            else:
                noted.discard(tag)
                last = tag
        if last is not None:
            self._send(last, multiple=True)
        if noted:
            self._flush = asyncio.get_running_loop().call_later(self._linger, self._send_late)

    def _send_late(self) -> None:
        self._send_head()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._send_rest()

    def _send_rest(self) -> None:
        """Each noted ack that no multiple ack can cover yet, on its own."""
        for tag in sorted(self._noted):
            self._gone.add(tag)
            self._send(tag, multiple=False)
        self._noted.clear()

    def _send(self, tag: int, *, multiple: bool) -> None:
        """Queue an ack for the channel's one writer: acks reach the broker in this order."""
        self._queued.append((tag, multiple))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_queued())

    async def _write_queued(self) -> None:
        # One writer: concurrent writers could pass each other in aiormq's write queue (when
        # it is full), and an ack of one tag behind the multiple ack that covered it already
        # makes the broker close the channel ("unknown delivery tag"). It queues each ack
        # without waiting for it to reach the socket, so that it keeps up under load.
        while self._queued:
            tag, multiple = self._queued.popleft()
            await self._write(tag, multiple)

    async def _write(self, tag: int, multiple: bool) -> None:
        try:
            await self.channel.basic_ack(tag, multiple=multiple, wait=False)
        except Exception as error:
            log.warning(
                "could not ack delivery %d%s (%s); RabbitMQ delivers it again",
                tag,
                " and the ones before it" if multiple else "",
                why(error),
            )
