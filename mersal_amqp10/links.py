"""Sender and receiver links, each in a session of its own.

RabbitMQ 3.x ends the whole session when an attach fails, and returns a link's unsettled
messages only when its session ends, so a link never shares its session.

A `Sender` sends messages unsettled, many in flight (at most `MAX_IN_FLIGHT`), and each send
completes when the peer's disposition arrives. A `Receiver` gives the peer `prefetch` credit,
then gives back the credit of settled deliveries, but only once the peer has used all it was
given: RabbitMQ 3.x takes a flow's `link-credit` as new credit counted from its own delivery
count, so credit given while transfers are on the wire lets it send more than `prefetch`. A
peer that sends past its credit anyway ends the receiver with an error.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass

import proton

from mersal_amqp10.engine import Engine

MAX_IN_FLIGHT = 1_000
"""Messages a sender link has sent and not yet heard the outcome of."""
ATTACH_TIMEOUT = 10.0
"""Seconds the peer has to attach a link."""

_names = itertools.count()


class LinkRefused(ConnectionError):
    """The peer refused to attach a link, or ended it."""


LOST = -1
"""The state of a message whose link ended before the peer's outcome came."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the peer made of a message sent: a state (`proton.Delivery.ACCEPTED`, ...), and why.

    `LOST`, with the link's error in `lost`, when the link ended before the outcome came.
    """

    state: int
    condition: proton.Condition | None = None
    lost: Exception | None = None

    @property
    def accepted(self) -> bool:
        """Whether the peer took the message."""
        return self.state == proton.Delivery.ACCEPTED


class _Link:
    """A link in a session of its own, and its attach: `opened()` waits for the peer's."""

    def __init__(self, engine: Engine, address: str, link: proton.Link) -> None:
        self.address = address
        self.error: Exception | None = None
        self._engine = engine
        self._link = link
        loop = asyncio.get_running_loop()
        self._opened: asyncio.Future[None] = loop.create_future()
        self._ended: asyncio.Future[None] = loop.create_future()
        self._ending = False
        engine.own(link, self)

    async def opened(self) -> None:
        """Wait until the peer attached the link (raises if it refused)."""
        async with asyncio.timeout(ATTACH_TIMEOUT):
            await asyncio.shield(self._opened)

    def on_opened(self) -> None:
        """The peer attached the link (a refusal attaches without a terminus, then detaches)."""
        link = self._link
        terminus = link.remote_target if link.is_sender else link.remote_source
        if terminus is None or terminus.address is None:
            return  # refused: the detach follows
        if not self._opened.done():
            self._opened.set_result(None)

    def on_delivery(self, delivery: proton.Delivery) -> None:
        """A delivery arrived, or the peer's outcome for one: the kind of link says which."""

    def on_flow(self) -> None:
        """The credit changed: proton sends what waited for it by itself."""

    def on_closed(self, error: Exception) -> None:
        """Nothing more comes on the link (its session ended, as asked or not)."""
        if not self._ending:
            what = "sending to" if self._link.is_sender else "receiving from"
            self.error = LinkRefused(f"{what} {self.address!r}: {error}")
        if not self._opened.done():
            self._opened.set_exception(self.error or error)
            self._opened.exception()  # heard, even if nobody waits for the attach any more
        if not self._ended.done():
            self._ended.set_result(None)

    async def ended(self) -> None:
        """Wait until the peer ended the link's session, after `end()` (or the connection went)."""
        await asyncio.shield(self._ended)

    @property
    def usable(self) -> bool:
        """Whether the link is attached, or being attached, and not ended."""
        return self.error is None

    def end(self) -> None:
        """End the link's session: the peer returns what the link has not settled.

        `ended()` then waits for the peer's end: what was settled before counts only then.
        """
        if self.error is None:
            self.error = LinkRefused(f"the link of {self.address!r} was ended here")
        self._ending = True
        session = self._link.session
        if session.state & proton.Endpoint.LOCAL_ACTIVE:
            session.close()
            self._engine.touch()
        elif not self._ended.done():  # ended already, by the peer or with the connection
            self._engine.disown(self._link)
            self._ended.set_result(None)


def _session(engine: Engine) -> proton.Session:
    session = engine.connection.session()
    session.open()
    return session


class Sender(_Link):
    """A sender link to one address: `put` sends at once, its future the peer's outcome."""

    def __init__(self, engine: Engine, address: str) -> None:
        link = _session(engine).sender(f"mersal-sender-{next(_names)}")
        link.target.address = address
        link.snd_settle_mode = proton.Link.SND_UNSETTLED
        super().__init__(engine, address, link)
        self._outcomes: dict[str, asyncio.Future[Outcome]] = {}
        self._roomy = asyncio.Event()
        self._roomy.set()
        self._tags = itertools.count()
        self._loop = asyncio.get_running_loop()
        link.open()
        engine.touch()

    @property
    def full(self) -> bool:
        """Whether `MAX_IN_FLIGHT` messages await their outcome: `room()` waits for one."""
        return len(self._outcomes) >= MAX_IN_FLIGHT

    async def room(self) -> None:
        """Wait until fewer than `MAX_IN_FLIGHT` messages await their outcome."""
        while self.full and self.error is None:
            self._roomy.clear()
            await self._roomy.wait()

    def put(self, encoded: bytes) -> asyncio.Future[Outcome]:
        """Send one encoded message now (it leaves this turn); the future of its outcome.

        Raises if the link has ended; a link that ends later gives the outcome `lost`.
        """
        if self.error is not None:
            raise self.error
        tag = str(next(self._tags))
        link = self._link
        link.delivery(tag)
        link.send(encoded)
        link.advance()
        outcome: asyncio.Future[Outcome] = self._loop.create_future()
        self._outcomes[tag] = outcome
        self._engine.touch()
        return outcome

    async def send(self, encoded: bytes) -> Outcome:
        """Send one encoded message, waiting for room first; the peer's outcome."""
        await self.room()
        return await self.put(encoded)

    def on_delivery(self, delivery: proton.Delivery) -> None:
        """The peer's outcome for one message."""
        if not delivery.updated:
            return
        outcome = self._outcomes.pop(_text(delivery.tag), None)
        result = Outcome(delivery.remote_state, delivery.remote.condition)
        delivery.settle()
        if outcome is not None and not outcome.done():
            outcome.set_result(result)
        if not self._roomy.is_set() and not self.full:
            self._roomy.set()

    def on_closed(self, error: Exception) -> None:
        """Every send in flight ends with its outcome unknown (`lost`)."""
        super().on_closed(error)
        lost = Outcome(LOST, lost=self.error or error)
        outcomes, self._outcomes = list(self._outcomes.values()), {}
        for outcome in outcomes:
            if not outcome.done():
                outcome.set_result(lost)
        self._roomy.set()


def _text(tag: object) -> str:
    """A delivery tag as the str it was made from (proton gives it back as str or bytes)."""
    return tag.decode() if isinstance(tag, bytes) else str(tag)


class Receiver(_Link):
    """A receiver link from one address, its credit kept at the prefetch.

    Whole deliveries wait in `arrived`; `ready` is set when one arrives or the link ends.
    """

    def __init__(self, engine: Engine, address: str, prefetch: int, ready: asyncio.Event) -> None:
        link = _session(engine).receiver(f"mersal-receiver-{next(_names)}")
        link.source.address = address
        link.rcv_settle_mode = proton.Link.RCV_FIRST
        super().__init__(engine, address, link)
        self.prefetch = max(1, prefetch)
        self.arrived: deque[tuple[proton.Delivery, bytes]] = deque()
        self.ready = ready
        self.unsettled = 0
        """Deliveries received and not settled yet (buffered or handed out)."""
        self._owed_credit = 0
        self._holding = False
        link.open()
        link.flow(self.prefetch)
        engine.touch()

    def settle(self, delivery: proton.Delivery, outcome: int) -> None:
        """Settle `delivery` with `outcome` (raises if the link is gone: the peer has it back)."""
        if self.error is not None:
            raise self.error
        delivery.update(outcome)
        delivery.settle()
        self.unsettled -= 1
        self._owed_credit += 1
        self._top_up()
        self._engine.touch()

    def forget(self) -> None:
        """One delivery handed out is left unsettled, for the end of the session to return."""
        self.unsettled -= 1

    def hold(self) -> None:
        """Give no more credit: what the peer still sends stays unsettled, until `end()`."""
        self._holding = True

    def _top_up(self) -> None:
        """Give back the credit of settled deliveries, once the peer has used what it had."""
        if self._owed_credit and not self._holding and self._link.credit <= 0:
            self._link.flow(self._owed_credit)
            self._owed_credit = 0
            self._engine.touch()

    def on_delivery(self, delivery: proton.Delivery) -> None:
        """A message arrived, whole or in part: whole ones are buffered."""
        if self._ending:
            return  # its session is ending: the peer takes it back
        if not delivery.readable or delivery.partial or delivery.pending <= 0:
            return  # a part, or one read already (its disposition changed)
        encoded = self._link.recv(delivery.pending)
        self._link.advance()
        self.unsettled += 1
        if self.unsettled > self.prefetch:
            self.on_closed(LinkRefused(f"the broker sent past the credit of {self.prefetch}"))
            self.end()
            return
        self.arrived.append((delivery, encoded or b""))
        self.ready.set()
        self._top_up()

    def on_closed(self, error: Exception) -> None:
        """Nothing more arrives; what was not settled goes back to the queue at the peer."""
        super().on_closed(error)
        self.arrived.clear()
        self.ready.set()
