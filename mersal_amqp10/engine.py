"""Proton's AMQP 1.0 protocol engine, driven by asyncio: no reactor, no thread.

python-qpid-proton's `Container.run()` blocks, but its engine (`Connection`, `Transport`,
`Collector`) is a pure state machine: bytes go in with `push`, frames come out with `peek` and
`pop`, and what happened is read from the collector as events. `Engine` is the
`asyncio.Protocol` that feeds it the socket's bytes, hands each link's events to the link's
owner (`LinkOwner`), and writes what the engine has to say once per turn of the loop, so that
many sends, credits and settlements made in one turn leave in one write.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, cast

import proton
from cproton import (  # proton's C binding, which its Python classes wrap
    PN_DELIVERY,
    isnull,
    pn_collector_peek,
    pn_collector_pop,
    pn_delivery_link,
    pn_event_delivery,
    pn_event_type,
    pn_link_name,
)

log = logging.getLogger("mersal.amqp10")

_event = cast(Callable[[Any], "proton.Event | None"], proton.Event.wrap)
_delivery = cast(Callable[[Any], proton.Delivery], proton.Delivery.wrap)


class EngineClosed(ConnectionError):
    """The AMQP 1.0 connection is gone (closed by either side, or its socket lost)."""


class LinkOwner(Protocol):
    """What owns a link: it hears the link's events."""

    def on_delivery(self, delivery: proton.Delivery) -> None:
        """A delivery arrived (a receiver) or its peer's outcome did (a sender)."""
        ...

    def on_flow(self) -> None:
        """The link's credit changed."""
        ...

    def on_opened(self) -> None:
        """The peer attached the link."""
        ...

    def on_closed(self, error: Exception) -> None:
        """The link, its session or the connection ended: nothing more comes on it."""
        ...


class Engine(asyncio.Protocol):
    """One AMQP 1.0 connection: the engine's state, its socket, and who owns each link."""

    def __init__(self, user: str | None, password: str, vhost: str) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.connection = proton.Connection()
        self.connection.container = f"mersal-{uuid.uuid4().hex[:12]}"
        self.connection.hostname = f"vhost:{vhost}"  # how RabbitMQ 3.x picks the vhost
        self.wire = proton.Transport()
        sasl = self.wire.sasl()
        if user is None:
            sasl.allowed_mechs("ANONYMOUS")
        else:
            self.connection.user = user
            self.connection.password = password
            sasl.allowed_mechs("PLAIN")
            sasl.allow_insecure_mechs = True  # PLAIN without TLS, as amqp:// sends it
        self.wire.bind(self.connection)
        self._collector = proton.Collector()
        self.connection.collect(self._collector)
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[Exception] = loop.create_future()
        self._socket: asyncio.Transport | None = None
        self._owners: dict[str, LinkOwner] = {}
        self._flushing = False
        self._ticking: asyncio.TimerHandle | None = None

    # The socket's side.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Open the AMQP connection as the socket connects."""
        self._socket = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.connection.open()
        self.touch()

    def data_received(self, data: bytes) -> None:
        """Feed the engine what the peer wrote, and act on what it makes of it."""
        view = memoryview(data)
        while view:
            room = self.wire.capacity()
            if room <= 0:
                break
            self.wire.push(bytes(view[:room]))
            view = view[room:]
            self._process()
        self._flush()

    def eof_received(self) -> bool | None:
        """The peer stopped writing."""
        self.wire.close_tail()
        self._process()
        self._flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: every link ends."""
        self._end(EngineClosed(f"the connection to the broker was lost ({exc or 'closed'})"))

    # The engine's side.

    def own(self, link: proton.Link, owner: LinkOwner) -> None:
        """Hand the events of `link` to `owner`."""
        self._owners[link.name] = owner

    def disown(self, link: proton.Link) -> None:
        """Stop handing the events of `link` to anyone."""
        self._owners.pop(link.name, None)

    def touch(self) -> None:
        """Something local changed (a send, a credit, a settlement): write it this turn."""
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def close(self) -> None:
        """Close the connection: the peer returns what was not settled."""
        if not self.closed.done():
            self.connection.close()
            self.touch()

    def abort(self) -> None:
        """Drop the socket at once."""
        if self._socket is not None:
            self._socket.abort()

    def _flush(self) -> None:
        self._flushing = False
        self._process()
        socket = self._socket
        pending = self.wire.pending()
        while pending > 0 and socket is not None and not socket.is_closing():
            socket.write(self.wire.peek(pending) or b"")  # the engine gives a frame or so
            self.wire.pop(pending)
            pending = self.wire.pending()
        if pending < 0 and socket is not None:  # the engine is done writing
            socket.close()
        self._tick()

    def _tick(self) -> None:
        """Keep the idle timeout: the engine says when it next has to send an empty frame."""
        if self._ticking is not None or self.closed.done():
            return
        deadline = self.wire.tick(time.monotonic())
        if deadline > 0:
            self._ticking = self._loop.call_at(
                self._loop.time() + max(0.0, deadline - time.monotonic()), self._on_tick
            )

    def _on_tick(self) -> None:
        self._ticking = None
        self.touch()

    def _process(self) -> None:
        """Hand out the collector's events; a delivery's without proton's `Event` wrappers.

        `Collector.peek` wraps each event's delivery, link, session, connection and transport
        in Python objects; for the delivery events (two per message, nearly all there are) the
        owner needs only the delivery, found by its link's name through proton's C binding.
        """
        collector = self._collector._impl
        while not isnull(impl := pn_collector_peek(collector)):
            try:
                if pn_event_type(impl) == PN_DELIVERY:
                    self._delivered(pn_event_delivery(impl))
                else:
                    event = _event(impl)
                    if event is not None:
                        self._dispatch(event)
            finally:
                pn_collector_pop(collector)

    def _delivered(self, impl: Any) -> None:
        owner = self._owners.get(pn_link_name(pn_delivery_link(impl)))
        if owner is not None:
            owner.on_delivery(_delivery(impl))

    def _dispatch(self, event: proton.Event) -> None:
        kind = event.type
        if kind == proton.Event.LINK_FLOW:
            owner = self._owner(event.link)
            if owner is not None:
                owner.on_flow()
        elif kind == proton.Event.LINK_REMOTE_OPEN:
            owner = self._owner(event.link)
            if owner is not None:
                owner.on_opened()
        elif kind in (proton.Event.LINK_REMOTE_CLOSE, proton.Event.LINK_REMOTE_DETACH):
            if event.link is not None:
                self._link_ended(event.link, "the broker detached the link")
        elif kind == proton.Event.SESSION_REMOTE_CLOSE:
            session = event.session
            if session is None:
                return
            for link in self._links_of(session):
                self._link_ended(link, "the broker ended the link's session", session)
            if session.state & proton.Endpoint.LOCAL_ACTIVE:
                session.close()
        elif kind == proton.Event.CONNECTION_REMOTE_OPEN:
            if not self.opened.done():
                self.opened.set_result(None)
        elif kind == proton.Event.CONNECTION_REMOTE_CLOSE:
            reason = condition_text(self.connection.remote_condition)
            if self.connection.state & proton.Endpoint.LOCAL_ACTIVE:
                self.connection.close()
            self._end(EngineClosed(f"the broker closed the connection{reason}"))
        elif kind in (proton.Event.TRANSPORT_ERROR, proton.Event.TRANSPORT_CLOSED):
            reason = condition_text(self.wire.condition)
            self._end(EngineClosed(f"the AMQP 1.0 connection ended{reason}"))

    def _owner(self, link: proton.Link | None) -> LinkOwner | None:
        return None if link is None else self._owners.get(link.name)

    def _links_of(self, session: proton.Session) -> list[proton.Link]:
        found: list[proton.Link] = []
        link = self.connection.link_head(0)
        while link is not None:
            if link.session == session:
                found.append(link)
            link = link.next(0)
        return found

    def _link_ended(
        self, link: proton.Link, what: str, endpoint: proton.Endpoint | None = None
    ) -> None:
        owner = self._owners.pop(link.name, None)
        condition = (endpoint or link).remote_condition or link.remote_condition
        if (
            link.state & proton.Endpoint.LOCAL_ACTIVE
            and link.session.state & proton.Endpoint.LOCAL_ACTIVE
        ):
            link.close()
        self.touch()
        if owner is not None:
            owner.on_closed(EngineClosed(f"{what}{condition_text(condition)}"))

    def _end(self, error: Exception) -> None:
        if self.closed.done():
            return
        self.closed.set_result(error)
        if not self.opened.done():
            self.opened.set_exception(error)
        if self._ticking is not None:
            self._ticking.cancel()
        owners, self._owners = list(self._owners.values()), {}
        for owner in owners:
            owner.on_closed(error)
        if self._socket is not None:
            self._socket.close()


def condition_text(condition: proton.Condition | None) -> str:
    """': name: description' for a condition the peer sent, else ''."""
    if condition is None:
        return ""
    text = f": {condition.name}"
    return f"{text}: {condition.description}" if condition.description else text


async def connect(
    host: str,
    port: int,
    *,
    user: str | None,
    password: str,
    vhost: str,
    tls: ssl.SSLContext | None = None,
    timeout: float = 10.0,
) -> Engine:
    """An open AMQP 1.0 connection to `host:port`, logged in to `vhost` (over TLS with `tls`).

    With a `user`, SASL PLAIN; without, SASL ANONYMOUS.
    """
    loop = asyncio.get_running_loop()
    engine: Engine | None = None
    try:
        async with asyncio.timeout(timeout):
            _, engine = await loop.create_connection(
                lambda: Engine(user, password, vhost), host, port, ssl=tls
            )
            await engine.opened
    except BaseException as error:
        if engine is not None:
            engine.abort()
        if isinstance(error, TimeoutError):
            raise TimeoutError(
                f"no AMQP 1.0 answer from {host}:{port} within {timeout:g}s"
            ) from None
        raise
    return engine
