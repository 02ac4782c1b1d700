"""The AMQP 1.0 transport (`amqp10://…`, `amqps10://…`): proton's engine on asyncio.

It composes the parts, each in a module of its own:

- `engine`: proton's protocol engine driven by an `asyncio.Protocol`, no reactor, no thread;
- `links`: sender links (unsettled, pipelined sends) and receiver links (credit = prefetch);
- `connection`: the connection, opened again with backoff, and a sender per address;
- `consuming`: consumers and their deliveries, settled accepted, released or rejected;
- `topology`: queues, bindings and wait queues, which AMQP 1.0 leaves to each broker;
- `wire`: envelopes to and from AMQP 1.0 messages.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Collection, Sequence
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import proton

from mersal.errors import ConfigurationError, MersalError, OutcomeUnknown, Unsendable
from mersal.inspection import QueueReport
from mersal.messages import describe
from mersal.transport import Outgoing, first_failure
from mersal.transport.limits import Limits, problem_of
from mersal.urls import mask
from mersal_amqp10.connection import Connection, Peer
from mersal_amqp10.consuming import RESUBSCRIBE_DELAYS, Amqp10Consumer
from mersal_amqp10.engine import condition_text
from mersal_amqp10.links import LinkRefused, Outcome
from mersal_amqp10.topology import QueuesByName, RabbitMQ3Topology, Topology
from mersal_amqp10.wire import encode
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.urls import seconds_option

log = logging.getLogger("mersal.amqp10")

MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Header bytes a message may carry: more than a 0-9-1 frame, as AMQP 1.0 messages span frames."""
END_TIMEOUT = 2.0
"""Seconds a stop waits for the broker to end the sessions of closed consumers."""

SCHEMES = {"amqp10": ("amqp", 5672), "amqps10": ("amqps", 5671)}
"""Our scheme -> the 0-9-1 scheme the topology connects with, and the default port."""
TOPOLOGIES = ("rabbitmq", "queues")
"""`?topology=`: RabbitMQ 3.x (queues made over 0-9-1), or a broker that makes them by name."""


class Amqp10Transport:
    """The `amqp10://` transport: AMQP 1.0 to RabbitMQ 3.x's plugin, queues made over 0-9-1.

    `url` is `amqp10://user:password@host:port/vhost` (`amqps10://` for TLS, with the
    `cafile`, `certfile`, `keyfile` and `no_verify_ssl` options). `queue_type` (or
    `?queue_type=` in the URL) is that of the 0-9-1 transport: quorum by default.
    `reconnect_interval` is the first pause before connecting again (doubled each time, up to
    30 s). `?topology=queues` is for a broker that makes a queue when a link first names it
    (addresses are queue names; no topics, no delays); `topology=` takes any `Topology`. A
    send completes when the broker accepted the message, within `publish_timeout`.
    """

    resubscribe_delays: Sequence[float] = RESUBSCRIBE_DELAYS
    """The pauses between an ended receiver's attempts to attach again; then `get()` raises."""

    def __init__(
        self,
        url: str,
        *,
        queue_type: str | None = None,
        publish_timeout: float = 10.0,
        topology: Topology | None = None,
    ) -> None:
        if not publish_timeout > 0:
            raise ConfigurationError(
                f"Amqp10Transport(publish_timeout={publish_timeout!r}) must be > 0 seconds"
            )
        self.address = url
        self.publish_timeout = publish_timeout
        peer, topology_url, interval, kind = _parse(url)
        self._peer = peer
        self._reconnect_interval = interval
        if topology is None:
            topology = (
                QueuesByName()
                if kind == "queues"
                else RabbitMQ3Topology(topology_url, queue_type=queue_type)
            )
        self._topology: Topology = topology
        self.limits = _limits(self._topology)
        self._connection = Connection(peer, reconnect_interval=interval)
        self._consumers: set[Amqp10Consumer] = set()

    def __repr__(self) -> str:
        return f"<Amqp10Transport {mask(self.address)}>"

    @property
    def connected(self) -> bool:
        """Whether the AMQP 1.0 connection is up right now."""
        return self._connection.connected

    @property
    def topology(self) -> Topology:
        """What declares queues, bindings and wait queues on this broker."""
        return self._topology

    # The Transport protocol.

    async def start(self) -> None:
        """Connect the topology, then open the AMQP 1.0 connection."""
        if self._connection.engine is not None:
            return
        await self._topology.start()
        self.limits = _limits(self._topology)
        self._connection = Connection(self._peer, reconnect_interval=self._reconnect_interval)
        try:
            await self._connection.open()
        except BaseException as error:
            await self._topology.stop()
            if isinstance(error, (OSError, TimeoutError, ConnectionError)):
                raise MersalError(
                    f"cannot open an AMQP 1.0 connection to {mask(self.address)} ({error}): is "
                    "the broker's AMQP 1.0 listener on (RabbitMQ 3.x: rabbitmq-plugins enable "
                    "rabbitmq_amqp1_0)?"
                ) from None
            raise
        log.info("connected over AMQP 1.0 to %s", mask(self.address))

    async def stop(self) -> None:
        """Disconnect: the broker returns what was not settled; temporary queues are deleted."""
        consumers, self._consumers = list(self._consumers), set()
        for consumer in consumers:
            await consumer.close()
        ending = [consumer.ended() for consumer in consumers if consumer.settled_all]
        try:  # the broker counts what was settled once a session's end is through, not before
            async with asyncio.timeout(END_TIMEOUT):
                await asyncio.gather(*ending)
        except TimeoutError:
            log.warning("the broker did not end the receivers' sessions within %gs", END_TIMEOUT)
        await self._connection.close()
        await self._topology.stop()

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Make sure `queue` exists (through the topology)."""
        await self._topology.declare(queue, temporary=temporary, partitions=partitions)

    async def declare_error_queue(self, queue: str) -> None:
        """Make sure the error queue `queue` exists (a classic queue on RabbitMQ)."""
        await self._topology.declare_error_queue(queue)

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        await self._topology.bind(queue, topic)

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Stop delivering to `queue` what is published on any topic not in `topics`."""
        await self._topology.prune_bindings(queue, topics)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Send all messages, in order, each accepted by the broker within publish_timeout."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Send every message it can, in order, all in flight at once; for each, None or why."""
        results: list[Exception | None] = [None] * len(messages)
        carried: list[int] = []
        for index, outgoing in enumerate(messages):
            problem = problem_of(outgoing, self.limits)
            if problem is None:
                carried.append(index)
            else:
                results[index] = Unsendable(f"cannot send it to {outgoing.address!r}: {problem}")
        targets = await self._topology.targets([messages[index] for index in carried])
        sends: list[tuple[int, str, Outgoing]] = []
        for index, target in zip(carried, targets, strict=True):
            if isinstance(target, Exception):
                results[index] = target
            else:
                sends.append((index, target, messages[index]))
        for (index, _, _), result in zip(sends, await self._send_all(sends), strict=True):
            results[index] = result
        return results

    async def _send_all(self, sends: Sequence[tuple[int, str, Outgoing]]) -> list[Exception | None]:
        """Put every message on its address's link, in order, then wait for the outcomes.

        One deadline for the batch: what has no outcome by then is "outcome unknown".
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_timeout
        sent: list[asyncio.Future[Outcome] | Exception] = []
        for _, address, outgoing in sends:
            sender = self._connection.cached_sender(address)
            try:
                if sender is None or sender.full:
                    async with asyncio.timeout_at(deadline):
                        sender = await self._connection.sender(address)
                        await sender.room()
                sent.append(sender.put(encode(outgoing.envelope)))
            except TimeoutError:
                sent.append(self._unknown(outgoing))
            except LinkRefused as error:
                if sender is not None:
                    self._connection.drop_sender(sender)
                sent.append(OutcomeUnknown(f"{_what(outgoing)} was not sent ({error}): send again"))
            except MersalError as error:  # the connection is closed for good
                sent.append(OutcomeUnknown(f"{_what(outgoing)} was not sent ({error})"))
        waiting = [future for future in sent if isinstance(future, asyncio.Future)]
        if waiting:
            await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()))
        return [
            self._result(outgoing, address, future)
            for (_, address, outgoing), future in zip(sends, sent, strict=True)
        ]

    def _result(
        self, outgoing: Outgoing, address: str, sent: asyncio.Future[Outcome] | Exception
    ) -> Exception | None:
        if isinstance(sent, Exception):
            return sent
        if not sent.done():
            return self._unknown(outgoing)
        outcome = sent.result()
        if outcome.lost is not None:
            return OutcomeUnknown(f"{_what(outgoing)} had no outcome ({outcome.lost}): send again")
        return _result(outgoing, address, outcome)

    def _unknown(self, outgoing: Outgoing) -> OutcomeUnknown:
        return OutcomeUnknown(
            f"{_what(outgoing)} was not accepted within {self.publish_timeout:g}s; send it "
            "again (the receiver's inbox drops duplicates)"
        )

    async def consume(self, queue: str, *, prefetch: int) -> Amqp10Consumer:
        """Start receiving from an existing `queue` (and its partitions), `prefetch` credit each."""
        consumer = Amqp10Consumer(
            self._connection, self._topology, queue, prefetch, self.resubscribe_delays
        )
        await consumer.start()
        self._consumers.add(consumer)
        return consumer

    # For `mersal status` and `mersal dlq`, which ask the broker over 0-9-1.

    async def queue_status(
        self,
        names: Sequence[str],
        *,
        waits_of: Sequence[str] = (),
        delays: Sequence[float] = (),
        management: str | None = None,
    ) -> QueueReport:
        """Ready, unacked and consumer counts of `names` and their wait queues (see amqp://)."""
        return await self._rabbitmq().queue_status(
            names, waits_of=waits_of, delays=delays, management=management
        )

    async def check_give_back(self, queue: str, management: str | None = None) -> None:
        """Raise LookingWouldLose if messages of `queue` given back could be dropped."""
        await self._rabbitmq().check_give_back(queue, management)

    def _rabbitmq(self) -> RabbitMQTransport:
        topology = self._topology
        if not isinstance(topology, RabbitMQ3Topology):
            raise ConfigurationError(f"{type(topology).__name__} cannot report on queues")
        return topology.rabbitmq


def _limits(topology: Topology) -> Limits:
    """RabbitMQ's limits, but headers are not bound by one frame: messages span frames."""
    return Limits(max_delay=topology.limits.max_delay, max_header_bytes=MAX_HEADER_BYTES)


def _result(outgoing: Outgoing, address: str, outcome: Outcome) -> Exception | None:
    if outcome.accepted:
        return None
    why = condition_text(outcome.condition)
    if outcome.state == proton.Delivery.REJECTED:
        return Unsendable(f"the broker rejected {_what(outgoing)} (at {address!r}){why}")
    return MersalError(
        f"the broker did not take {_what(outgoing)} (at {address!r}, outcome "
        f"{_state_name(outcome.state)}){why}: it may be short of memory or disk, or the queue "
        "full; send it again later"
    )


def _state_name(state: int) -> str:
    names: dict[int, str] = {
        int(proton.Delivery.RELEASED): "released",
        int(proton.Delivery.MODIFIED): "modified",
        int(proton.Delivery.REJECTED): "rejected",
    }
    return names.get(state, str(state))


def _what(outgoing: Outgoing) -> str:
    return f"{describe(outgoing.envelope.headers)} to {outgoing.address!r}"


def _parse(url: str) -> tuple[Peer, str, float, str]:
    """The peer, the topology's 0-9-1 URL, the reconnect interval and topology, from our URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigurationError(f"{mask(url)} is not an amqp10:// or amqps10:// URL")
    if ";" in url:
        raise ConfigurationError(
            f"{mask(url)} lists several nodes: the AMQP 1.0 transport connects to one; put a "
            "load balancer in front of the nodes, or use amqp:// for failover"
        )
    plain, default_port = SCHEMES[scheme]
    try:
        port = parts.port or default_port
    except ValueError:
        raise ConfigurationError(f"{mask(url)} has a port that is not a number") from None
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    interval = seconds_option(options.pop("reconnect_interval", "1"), "reconnect_interval")
    kind = options.pop("topology", "rabbitmq")
    if kind not in TOPOLOGIES:
        raise ConfigurationError(
            f"{mask(url)}: topology={kind!r} must be one of {', '.join(TOPOLOGIES)}"
        )
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    peer = Peer(
        host=parts.hostname or "localhost",
        port=port,
        user=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password or ""),
        vhost=vhost,
        tls=_tls(options) if plain == "amqps" else None,
    )
    netloc = parts.netloc
    query = urlencode(options)
    topology_url = f"{plain}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    return peer, topology_url, interval, kind


def _tls(options: dict[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=options.get("cafile") or None)
    if options.get("certfile"):
        context.load_cert_chain(options["certfile"], options.get("keyfile") or None)
    if options.get("no_verify_ssl", "0").lower() in ("1", "true", "yes"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
