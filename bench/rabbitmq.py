"""Round trips through an App on RabbitMQ, against raw aio-pika doing the same by hand.

One run, in one process, on a vhost of its own (made with `rabbitmqctl`, deleted at the end):

- Framework: an App sends small dataclass messages to its own queue (persistent, confirmed:
  what the transport does), and a counting handler takes them.
- Raw aio-pika, the same by hand: a confirming channel publishes persistent messages with the
  same body through the default exchange into a durable queue, while a consumer on another
  channel, with the App's prefetch and manual acks, decodes each into the dataclass and acks it.

Full load: each sends `MESSAGES` from `IN_FLIGHT` concurrent senders; messages per second from
the first send to the last handled, and this process's CPU time per message (the client is
CPU-bound here, and CPU per message varies less than the rates when the broker shares the
cores). Half load: then each sends at half the rate the framework reached, on a schedule that
does not drift, for `HALF_LOAD_SECONDS` (at most `HALF_LOAD_MESSAGES`). Successive runs
alternate which side goes first.

Each message carries its send time (`time.perf_counter()`, same process) and the receiving
side records now - sent, so the latencies are send to handler. Each side first sends `WARM_UP`
unmeasured messages, which also opens the App's lazily created publishing channels.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import aio_pika
import msgspec
from aio_pika.abc import AbstractConnection, AbstractExchange, AbstractIncomingMessage

from bench.support import (
    PREFETCH,
    QUEUE_TYPE,
    Phase,
    Tally,
    percentile_ms,
    private_vhost,
)
from mersal import App

MESSAGES = 10_000
IN_FLIGHT = 128
WARM_UP = 300
HALF_LOAD_SECONDS = 5.0
HALF_LOAD_MESSAGES = 3_000
NOTE = "a small note"


_runs = itertools.count()
"""Runs so far in this process: odd runs measure raw aio-pika first, so order biases neither."""


@dataclass
class Ping:
    """The benchmark's message: small, and stamped with the time it was sent."""

    n: int
    sent: float
    note: str


MAX_CPU_RATIO = 1.6
"""The App's CPU per message may be at most this many times raw aio-pika's (the median of the
runs; 1.46 on quorum queues when this was set): past it, `python -m bench` exits 1."""


async def run() -> dict[str, float | int]:
    """Both round trips at full load, then at half load, on a vhost that is gone afterwards."""
    async with (
        private_vhost() as url,
        AppRoundTrip(url) as framework,
        RawRoundTrip(url) as raw,
    ):
        paths: dict[str, RoundTrip] = {"rabbitmq": framework, "raw": raw}
        order = list(paths) if next(_runs) % 2 == 0 else list(reversed(paths))
        full = {name: await full_load(paths[name], MESSAGES) for name in order}
        half_rate = full["rabbitmq"].rate / 2
        half = {name: await half_load(paths[name], half_rate) for name in order}
    app, plain = full["rabbitmq"], full["raw"]
    figures: dict[str, float | int] = {
        "rabbitmq_roundtrip_msgs_per_s": app.rate,
        "raw_roundtrip_msgs_per_s": plain.rate,
        "rabbitmq_ratio_to_raw": app.rate / plain.rate,
        "rabbitmq_cpu_us_per_msg": app.cpu_seconds * 1e6,
        "raw_cpu_us_per_msg": plain.cpu_seconds * 1e6,
        "rabbitmq_cpu_ratio_to_raw": app.cpu_seconds / plain.cpu_seconds,
        "half_load_msgs_per_s": half_rate,
    }
    for name in paths:
        for load, phase in (("half", half[name]), ("full", full[name])):
            for percent in (50, 99):
                figures[f"{name}_{load}_load_p{percent}_ms"] = percentile_ms(
                    phase.latencies, percent
                )
    return figures


def check(medians: dict[str, float | int]) -> str | None:
    """A regression when the App's CPU per message passes MAX_CPU_RATIO times raw aio-pika's."""
    ratio = medians["rabbitmq_cpu_ratio_to_raw"]
    if ratio <= MAX_CPU_RATIO:
        return None
    return (
        f"the App's CPU per message is {ratio:.2f}x raw aio-pika's "
        f"({medians['rabbitmq_cpu_us_per_msg']:.0f} against {medians['raw_cpu_us_per_msg']:.0f} "
        f"us), past the agreed {MAX_CPU_RATIO}x: find what the round trip does more (profile "
        "it: python -m cProfile), or agree on a new margin in bench/rabbitmq.py"
    )


# The two ways of making the round trip.


class RoundTrip(Protocol):
    """Sends a message to a queue and counts it in `tally` when it comes back."""

    tally: Tally

    async def send(self, message: Ping) -> None:
        """Send one message; returns once the broker confirmed it."""
        ...


class AppRoundTrip:
    """An App on RabbitMQ that sends to its own queue, with a counting handler."""

    def __init__(self, url: str) -> None:
        self.tally = Tally(0)
        self.app = App(f"bench-{uuid.uuid4().hex[:8]}", transport=url)

        async def count(message: Ping) -> None:
            self.tally.record(time.perf_counter() - message.sent)

        self.app.register(Ping, count)
        self.app.route(Ping, self.app.name)

    async def send(self, message: Ping) -> None:
        """Send through the App: its outgoing pipeline, then a confirmed publish."""
        await self.app.send(message)

    async def __aenter__(self) -> AppRoundTrip:
        await self.app.start()
        try:
            await full_load(self, WARM_UP)
        except BaseException:
            await self.app.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.app.stop()


class RawRoundTrip:
    """The same round trip by hand: a confirming publisher channel and an acking consumer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tally = Tally(0)
        self.queue = f"bench-raw-{uuid.uuid4().hex[:8]}"
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(Ping)
        self._connection: AbstractConnection | None = None
        self._exchange: AbstractExchange | None = None

    async def send(self, message: Ping) -> None:
        """Publish one persistent message and wait for its confirm."""
        assert self._exchange is not None
        body = aio_pika.Message(
            self._encoder.encode(message), delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        )
        await self._exchange.publish(body, routing_key=self.queue)

    async def _receive(self, message: AbstractIncomingMessage) -> None:
        self.tally.record(time.perf_counter() - self._decoder.decode(message.body).sent)
        await message.ack()

    async def __aenter__(self) -> RawRoundTrip:
        self._connection = await aio_pika.connect(self.url)
        try:
            publishing = await self._connection.channel(publisher_confirms=True)
            self._exchange = publishing.default_exchange
            consuming = await self._connection.channel()
            await consuming.set_qos(prefetch_count=PREFETCH)
            queue = await consuming.declare_queue(
                self.queue, durable=True, arguments={"x-queue-type": QUEUE_TYPE}
            )
            await queue.consume(self._receive, no_ack=False)
            await full_load(self, WARM_UP)
        except BaseException:
            await self._connection.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            await self._connection.close()


# The phases.


async def full_load(path: RoundTrip, count: int) -> Phase:
    """Send `count` messages with `IN_FLIGHT` sends always outstanding."""
    tally = path.tally = Tally(count)
    numbers = itertools.count()

    async def sender() -> None:
        while (n := next(numbers)) < count:
            await path.send(Ping(n, time.perf_counter(), NOTE))

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(sender() for _ in range(min(IN_FLIGHT, count))))
    await tally.wait()
    return tally.phase(started, cpu)


async def half_load(path: RoundTrip, rate: float) -> Phase:
    """Send at a steady `rate` per second, for `HALF_LOAD_SECONDS` or `HALF_LOAD_MESSAGES`."""
    count = max(1, min(HALF_LOAD_MESSAGES, round(rate * HALF_LOAD_SECONDS)))
    tally = path.tally = Tally(count)
    interval = 1.0 / rate
    sends: list[asyncio.Task[None]] = []
    started, cpu = time.perf_counter(), time.process_time()
    due = started
    for n in range(count):
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sends.append(asyncio.create_task(path.send(Ping(n, time.perf_counter(), NOTE))))
        due += interval  # from the schedule, not from now: a late send does not shift the rest
    await asyncio.gather(*sends)
    await tally.wait()
    return tally.phase(started, cpu)


# The vhost.
