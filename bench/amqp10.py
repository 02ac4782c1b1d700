"""Round trips through an App on `amqp10://`, beside `amqp://` and a raw proton client; a backlog.

One run, in one process, on a RabbitMQ vhost of its own (made with `rabbitmqctl`, deleted at
the end), for each queue type (quorum, what an App declares by default, then classic):

- `amqp10`: bench.rabbitmq's round trip (an App sends small dataclass messages to its own
  queue, a counting handler takes them) with the App on `amqp10://` (`Amqp10Transport`:
  proton's engine on asyncio, the broker's AMQP 1.0 plugin; its queues made over 0-9-1).
- `amqp`: the same App, workload and queue type on `amqp://` (the 0-9-1 transport).
- `raw_proton`: the same by hand on the thinnest asyncio client over proton's engine
  (`mersal_amqp10.engine.connect`, `mersal_amqp10.links.Sender` and `Receiver`, no App): a
  sender link sends each message unsettled (a durable `proton.Message` with the JSON body in a
  data section) and waits for the broker's outcome, a receiver link with the App's prefetch as
  credit decodes each into the dataclass and settles it accepted. The queue is declared over
  0-9-1 as bench.rabbitmq's raw side declares it (durable, of the queue type).

Each sends `MESSAGES` from bench.rabbitmq's `IN_FLIGHT` concurrent senders, after `WARM_UP`
unmeasured ones; messages per second from the first send to the last handled, and this
process's CPU time per message (bench.support's `Tally`). Successive runs rotate which goes
first. `amqp10_vs_amqp` and `amqp10_vs_raw_proton` are ratios of the rates (higher: amqp10 is
faster), `*_cpu_vs_*` of the CPU per message (lower: amqp10 costs less); `classic_` figures are
the same on classic queues.

Then the backlog: `BACKLOG` messages as an App sends them (its headers, Mersal's AMQP 1.0
encoding, a new message id each) are sent by the raw proton sender into the queue of an App on
`amqp10://` (quorum, declared as the App declares it) before the App starts, with a prefetch of
`BACKLOG_PREFETCH`; while it drains them the process's resident set (/proc/self/statm) is read
every `RSS_INTERVAL` s: `backlog_rss_start_mb` once the App has started, the peak, and the end
once the last is handled (before the App starts, garbage is collected and the C heap's free
pages given back, so that memory the fill freed cannot hide growth). Drain rate and CPU per
message from before the App's start.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import itertools
import os
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import aio_pika
import msgspec
import proton

from bench.rabbitmq import (
    MESSAGES,
    NOTE,
    WARM_UP,
    AppRoundTrip,
    Ping,
    RoundTrip,
    full_load,
)
from bench.support import PREFETCH, QUEUE_TYPE, Phase, Tally, private_vhost
from mersal import App
from mersal.messages import Envelope, Header, new_id, type_name_of
from mersal.serialization import JsonCodec
from mersal_amqp10 import Amqp10Transport
from mersal_amqp10.engine import Engine, connect
from mersal_amqp10.links import MAX_IN_FLIGHT, Receiver, Sender
from mersal_amqp10.topology import queue_address
from mersal_amqp10.wire import encode

QUEUE_TYPES = (QUEUE_TYPE, "classic")
"""The queue types measured: the App's default first (unprefixed figures), then the other."""
BACKLOG = 100_000
BACKLOG_PREFETCH = 32
"""The backlog App's prefetch: small (the least its default concurrency of 32 allows)."""
RSS_INTERVAL = 0.5
CLOSE_TIMEOUT = 2.0

PATHS = ("amqp10", "amqp", "raw_proton")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

_runs = itertools.count()
"""Runs so far in this process: each run starts the rotation of `PATHS` one further on."""


async def run() -> dict[str, float | int]:
    """The three round trips on each queue type, then the backlog, on a vhost of their own."""
    rotation = next(_runs) % len(PATHS)
    order = [*PATHS[rotation:], *PATHS[:rotation]]
    figures: dict[str, float | int] = {}
    async with private_vhost("mersal-bench-amqp10") as url:
        for queue_type in QUEUE_TYPES:
            async with (
                AppRoundTrip(transport_url(url, "amqp10", queue_type)) as amqp10,
                AppRoundTrip(transport_url(url, "amqp", queue_type)) as amqp,
                RawProtonRoundTrip(url, queue_type) as raw,
            ):
                paths: dict[str, RoundTrip] = {"amqp10": amqp10, "amqp": amqp, "raw_proton": raw}
                full = {name: await full_load(paths[name], MESSAGES) for name in order}
            figures.update(roundtrip_figures(full, "" if queue_type == QUEUE_TYPE else "classic_"))
        figures.update(await backlog(url))
    return figures


def roundtrip_figures(full: dict[str, Phase], prefix: str) -> dict[str, float | int]:
    """Rates, CPU µs per message and the ratios, each name starting `prefix` after the path's."""
    figures: dict[str, float | int] = {}
    for name in PATHS:
        figures[f"{name}_{prefix}roundtrip_msgs_per_s"] = full[name].rate
        figures[f"{name}_{prefix}cpu_us_per_msg"] = full[name].cpu_seconds * 1e6
    amqp10 = full["amqp10"]
    for other in ("amqp", "raw_proton"):
        figures[f"amqp10_{prefix}vs_{other}"] = amqp10.rate / full[other].rate
        figures[f"amqp10_{prefix}cpu_vs_{other}"] = amqp10.cpu_seconds / full[other].cpu_seconds
    return figures


def transport_url(url: str, scheme: str, queue_type: str) -> str:
    """The private vhost's `url` with `scheme`, its queues of `queue_type` (the default: as is)."""
    rest = url.split("://", 1)[1]
    return f"{scheme}://{rest}" + ("" if queue_type == QUEUE_TYPE else f"?queue_type={queue_type}")


async def open_engine(url: str) -> Engine:
    """An AMQP 1.0 connection, on the broker's AMQP 1.0 port, to the vhost of `url` (amqp://)."""
    parts = urlsplit(url)
    return await connect(
        parts.hostname or "127.0.0.1",
        parts.port or 5672,
        user=unquote(parts.username or "guest"),
        password=unquote(parts.password or "guest"),
        vhost=unquote(parts.path[1:]) or "/",
    )


async def close_engine(engine: Engine) -> None:
    """Close the connection, dropping the socket if the broker does not answer in time."""
    engine.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await asyncio.shield(engine.closed)
    except TimeoutError:
        engine.abort()


async def declare_raw_queue(url: str, queue: str, queue_type: str) -> None:
    """Declare `queue` over 0-9-1 as bench.rabbitmq's raw side does: durable, of `queue_type`."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": queue_type})
    finally:
        await connection.close()


class RawProtonRoundTrip:
    """The round trip by hand on proton's engine: a sender link and a settling receiver link."""

    def __init__(self, url: str, queue_type: str) -> None:
        self.url = url
        self.queue_type = queue_type
        self.tally = Tally(0)
        self.queue = f"bench-proton-{uuid.uuid4().hex[:8]}"
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(Ping)
        self._engine: Engine | None = None
        self._sender: Sender | None = None
        self._receiving: asyncio.Task[None] | None = None

    async def send(self, message: Ping) -> None:
        """Send one durable message unsettled and wait for the broker to accept it."""
        assert self._sender is not None
        body = self._encoder.encode(message)
        encoded = proton.Message(body=body, inferred=True, durable=True).encode()
        outcome = await self._sender.send(encoded)
        if not outcome.accepted:
            raise RuntimeError(f"the broker did not accept message {message.n}: {outcome}")

    async def _receive(self, receiver: Receiver) -> None:
        """Decode each delivery into a Ping, count it, settle it accepted; until the link ends."""
        while receiver.usable:
            while receiver.arrived:
                delivery, encoded = receiver.arrived.popleft()
                message = proton.Message()
                message.decode(encoded)
                ping = self._decoder.decode(cast(bytes, message.body))  # a data section: bytes
                self.tally.record(time.perf_counter() - ping.sent)
                receiver.settle(delivery, proton.Delivery.ACCEPTED)
            receiver.ready.clear()
            await receiver.ready.wait()

    async def __aenter__(self) -> RawProtonRoundTrip:
        await declare_raw_queue(self.url, self.queue, self.queue_type)
        self._engine = engine = await open_engine(self.url)
        try:
            address = queue_address(self.queue)
            self._sender = Sender(engine, address)
            receiver = Receiver(engine, address, PREFETCH, asyncio.Event())
            await self._sender.opened()
            await receiver.opened()
            self._receiving = asyncio.create_task(self._receive(receiver))
            await full_load(self, WARM_UP)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._receiving is not None:
            self._receiving.cancel()
            with suppress(asyncio.CancelledError):
                await self._receiving
        if self._engine is not None:
            await close_engine(self._engine)


# The backlog.


@dataclass
class Drain:
    """What the backlog's drain measured."""

    fill_rate: float
    """Messages per second the raw proton sender put in the queue."""
    phase: Phase
    """The drain: messages per second from the App's start, CPU per message."""
    rss_mb: list[float]
    """The resident set in MB: at the App's start, every `RSS_INTERVAL` s, at the end."""


async def backlog(url: str) -> dict[str, float | int]:
    """Fill an App's queue with `BACKLOG` messages, then drain it while watching the RSS."""
    drain = await drain_backlog(transport_url(url, "amqp10", QUEUE_TYPE))
    start, end = drain.rss_mb[0], drain.rss_mb[-1]
    return {
        "backlog_messages": BACKLOG,
        "backlog_fill_msgs_per_s": drain.fill_rate,
        "backlog_drain_msgs_per_s": drain.phase.rate,
        "backlog_drain_cpu_us_per_msg": drain.phase.cpu_seconds * 1e6,
        "backlog_rss_start_mb": start,
        "backlog_rss_peak_mb": max(drain.rss_mb),
        "backlog_rss_end_mb": end,
        "backlog_rss_growth_mb": end - start,
        "backlog_rss_samples": len(drain.rss_mb),
    }


async def drain_backlog(url: str) -> Drain:
    """The queue of an App on `url` (amqp10://) filled, then drained by the App."""
    name = f"bench-backlog-{uuid.uuid4().hex[:8]}"
    declaring = Amqp10Transport(url)  # the queue as the App declares it
    await declaring.start()
    try:
        await declaring.declare(name)
    finally:
        await declaring.stop()
    fill_rate = await fill(url, name, BACKLOG)
    release_free_memory()  # what the fill freed cannot hide growth during the drain

    tally = Tally(BACKLOG)

    async def count(message: Ping) -> None:
        tally.record(None)

    app = App(name, transport=url, prefetch=BACKLOG_PREFETCH)
    app.register(Ping, count)
    app.route(Ping, name)
    samples: list[float] = []
    started, cpu = time.perf_counter(), time.process_time()
    await app.start()
    try:
        sampling = asyncio.create_task(sample_rss(samples))
        try:
            await tally.wait()
        finally:
            sampling.cancel()
            with suppress(asyncio.CancelledError):
                await sampling
        samples.append(rss_mb())
    finally:
        await app.stop()
    return Drain(fill_rate, tally.phase(started, cpu), samples)


async def fill(url: str, queue: str, count: int) -> float:
    """`count` messages sent into `queue` by the raw proton sender; messages per second."""
    engine = await open_engine(url.replace("amqp10://", "amqp://", 1))
    try:
        sender = Sender(engine, queue_address(queue))
        await sender.opened()
        encoder = msgspec.json.Encoder()
        numbers = iter(range(count))

        async def sending() -> None:
            for n in numbers:
                envelope = as_sent(encoder.encode(Ping(n, time.perf_counter(), NOTE)), queue)
                outcome = await sender.send(encode(envelope))
                if not outcome.accepted:
                    raise RuntimeError(f"the broker did not accept backlog message {n}: {outcome}")

        started = time.perf_counter()
        await asyncio.gather(*(sending() for _ in range(min(MAX_IN_FLIGHT, count))))
        return count / (time.perf_counter() - started)
    finally:
        await close_engine(engine)


def as_sent(body: bytes, queue: str) -> Envelope:
    """A Ping's envelope as an App on `queue` sends it to itself (mersal.pipeline's headers)."""
    message_id = new_id()
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: type_name_of(Ping),
        Header.SENT_AT: f"{time.time():.6f}",
        Header.CONTENT_TYPE: JsonCodec.content_type,
        Header.SOURCE: queue,
        Header.REPLY_TO: queue,
        Header.CORRELATION_ID: message_id,
    }
    return Envelope(headers, body)


async def sample_rss(samples: list[float]) -> None:
    """Append the resident set to `samples` now and every `RSS_INTERVAL` s, until cancelled."""
    while True:
        samples.append(rss_mb())
        await asyncio.sleep(RSS_INTERVAL)


def release_free_memory() -> None:
    """Collect garbage and give the C heap's free pages back to the OS (glibc's malloc_trim)."""
    gc.collect()
    with suppress(OSError, AttributeError):  # not glibc: the free pages stay resident
        ctypes.CDLL(None).malloc_trim(0)


def rss_mb() -> float:
    """This process's resident set in MB, from /proc/self/statm."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE / 2**20
