"""Scale-out: worker processes sharing one queue, relay processes sharing one outbox table.

One run, on a RabbitMQ vhost of its own (and, for the relays, a PostgreSQL database of its
own), both gone at its end:

- Workers. `MESSAGES` small messages wait in one queue (declared as the App declares its input
  queue: durable, quorum by default), then 1, 2 and 4 OS processes
  (`python -m bench.scaleout app-worker URL`) each run an App on that queue with a counting
  handler and the App's defaults (concurrency, prefetch). The messages are what an App sends:
  one is sent by a send-only App and read back raw, then copies of it (a new message id each)
  are published raw, persistent and confirmed. The processes start (import, connect) while the
  queue fills, and say `ready`; then this process says `go` to all of them at once, they start
  consuming, and each reports its count and the time of its last message (`time.monotonic()`,
  one clock for every process on Linux). Messages per second run from `go` to the last message
  handled by any of them. The raw side, in the same run, on the same queue and messages:
  processes (`raw-worker`) with an aio-pika consumer, the App's prefetch, one manual ack per
  message, each body decoded into the message class. Successive runs alternate which side goes
  first at each process count.
- Relays. 1, then 2, relay processes of one app (`python -m bench.outbox relay-instance NAME`:
  an App on the database, its relay listening) start while `RELAY_ROWS` outbox rows of that
  app are written in one transaction, committed (one NOTIFY) once they are all up; rows per
  second run from the commit to the outbox being empty. Then the messages in the target queue
  are counted: more than the rows are duplicates, fewer are missing. The table is vacuumed
  between the phases, and successive runs alternate which phase goes first.

Beside the rates, from /proc (NaN where it cannot be read): the CPU time per message (per
row) of the worker (relay) processes together and of the RabbitMQ server (its pid from
`rabbitmqctl eval`; all of its work, other users' included); the share of all cores busy
during each App and relay phase (every process on the machine, PostgreSQL's too), the same
over one second before the run (`background_cores_busy`: other work on the machine); and
`cores`. The broker, PostgreSQL, this process and the workers share the cores: once they are
busy, more processes cannot go faster.

`python -m bench.scaleout app-worker URL` and `raw-worker URL` are the worker processes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.outbox import ROOT, drained, private_database, twin_row
from bench.support import PHASE_TIMEOUT, PREFETCH, SBIN, private_vhost
from mersal import App, loop, message
from mersal_sqlalchemy import make_engine, make_tables
from mersal_sqlalchemy.outbox import write_outbox

QUEUE = "scale"
MESSAGES = 10_000
PROCESSES = (1, 2, 4)
FILL_IN_FLIGHT = 1_000
REPORT_INTERVAL = 0.05
"""Seconds between a worker's count reports (each carries the time of its last message)."""
STOP_TIMEOUT = 30.0
RELAY_APP = "scale-relay"
RELAY_SINK = "scale-relay-sink"
RELAY_ROWS = 10_000
RELAY_GRACE = 0.5
"""Seconds to wait after the outbox is empty before counting, for confirmed copies in transit."""
BACKGROUND_SECONDS = 1.0
"""Seconds the run first watches the cores with nothing of its own running (other work)."""
NOTE = "a small note"


_runs = itertools.count()
"""Runs so far in this process: odd runs measure raw first, and two relays before one."""


@message("bench.Tick.v1")
@dataclass
class Tick:
    """The workers' message: small; its handler only counts it."""

    n: int
    note: str


async def run() -> dict[str, float | int]:
    """Workers on one queue (App and raw), then relays on one outbox table."""
    number = next(_runs)
    if number == 0:
        print(f"# scaleout: {limit_note()}", flush=True)
    raw_first = number % 2 == 1
    background = CoreClock()
    await asyncio.sleep(BACKGROUND_SECONDS)
    idle_busy = background.busy()
    broker = await broker_pid()
    async with private_vhost("mersal-bench-scaleout") as url:
        drains = await workers_against_raw(url, broker, raw_first=raw_first)
        relays = await relays_one_and_two(url, broker, two_first=raw_first)
    figures: dict[str, float | int] = {}
    sides = (("app", ""), ("raw", "raw_"))
    for side, prefix in sides:
        for count in PROCESSES:
            figures[f"{prefix}workers{count}_msgs_per_s"] = drains[side, count].rate
    for side, prefix in sides:
        for count in PROCESSES[1:]:
            figures[f"{prefix}scale{count}_ratio"] = (
                drains[side, count].rate / drains[side, PROCESSES[0]].rate
            )
    for count in PROCESSES:
        figures[f"vs_raw{count}"] = drains["app", count].rate / drains["raw", count].rate
    for side, prefix in sides:
        for count in PROCESSES:
            usage = drains[side, count].usage
            figures[f"{prefix}workers{count}_cpu_us_per_msg"] = per_item_us(usage.processes)
            figures[f"{prefix}workers{count}_broker_cpu_us_per_msg"] = per_item_us(usage.broker)
    for count in PROCESSES:
        figures[f"workers{count}_cores_busy"] = drains["app", count].usage.busy
    figures["workers_smallest_share"] = drains["app", PROCESSES[-1]].smallest_share
    figures["workers_stop_max_s"] = max(drain.stop_seconds for drain in drains.values())
    one, two = relays[1], relays[2]
    figures |= {
        "relays1_rows_per_s": one.rate,
        "relays2_rows_per_s": two.rate,
        "relays2_ratio": two.rate / one.rate,
        "relays1_cpu_us_per_row": per_item_us(one.usage.processes, RELAY_ROWS),
        "relays2_cpu_us_per_row": per_item_us(two.usage.processes, RELAY_ROWS),
        "relays1_broker_cpu_us_per_row": per_item_us(one.usage.broker, RELAY_ROWS),
        "relays2_broker_cpu_us_per_row": per_item_us(two.usage.broker, RELAY_ROWS),
        "relays1_cores_busy": one.usage.busy,
        "relays2_cores_busy": two.usage.busy,
        "relays2_smaller_share": two.smallest_share,
        "relays_duplicates": one.duplicates + two.duplicates,
        "relays_missing": one.missing + two.missing,
        "background_cores_busy": idle_busy,
        "cores": os.cpu_count() or 0,
    }
    return figures


def per_item_us(seconds: float, items: int = MESSAGES) -> float:
    """CPU seconds spread over `items`, in microseconds each."""
    return seconds / items * 1e6


def limit_note() -> str:
    """What limits scaling out here, for the reader of the figures."""
    return (
        f"cores={os.cpu_count()}; RabbitMQ, PostgreSQL, this process and every worker or relay "
        "process share them, so more processes add throughput only while a core is idle "
        "(*_cores_busy near 1 means none was; *_cpu_us_per_* say who used them)"
    )


# Worker processes on one queue.


@dataclass
class Drain:
    """How a set of worker processes emptied the queue."""

    rate: float
    """Messages per second, from `go` to the last message handled."""
    usage: Usage
    """What the drain took of the machine; `processes` are the workers."""
    smallest_share: float
    """The share of the messages the least busy process handled."""
    stop_seconds: float
    """The longest any process's `App.stop()` (or raw `close()`) took once told to stop."""


async def workers_against_raw(
    url: str, broker: int | None, *, raw_first: bool
) -> dict[tuple[str, int], Drain]:
    """Each side's drain of `MESSAGES` with 1, 2 and 4 processes, by (side, processes)."""
    sample = await app_message(url)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        drains: dict[tuple[str, int], Drain] = {}
        for count in PROCESSES:
            for side in ("raw", "app") if raw_first else ("app", "raw"):
                drains[side, count] = await drain(url, broker, channel, sample, side, count)
        return drains
    finally:
        await connection.close()


async def app_message(url: str) -> AbstractIncomingMessage:
    """A Tick as an App puts it on the wire: sent by a send-only App, read back raw."""
    sender = App("scale-sender", transport=url, consume=False)
    sender.route(Tick, QUEUE)
    async with sender:
        await sender.transport.declare(QUEUE)  # the queue as the workers' App declares it
        await sender.send(Tick(0, NOTE))
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(QUEUE, passive=True)
        sample = await queue.get(no_ack=True, timeout=10)
        if sample is None:
            raise RuntimeError(f"the App's Tick did not reach queue {QUEUE!r}")
        return sample
    finally:
        await connection.close()


async def drain(
    url: str,
    broker: int | None,
    channel: AbstractChannel,
    sample: AbstractIncomingMessage,
    side: str,
    count: int,
) -> Drain:
    """Start `count` worker processes and fill the queue meanwhile; once they are ready, say
    `go` and time them emptying it."""
    async with Children(count, "bench.scaleout", f"{side}-worker", url) as workers:
        await asyncio.gather(fill(channel, sample, MESSAGES), workers.ready())
        watch = Watch(broker, workers.pids)
        started = time.monotonic()
        await workers.tell("go")
        finished = await workers.counted(MESSAGES)
        usage = watch.usage()
        await workers.stop()
        stops = [float((await child.expect("stopped")).split()[1]) for child in workers.children]
    left = await depth(channel, QUEUE)
    counts = [child.count for child in workers.children]
    if sum(counts) != MESSAGES or left:
        raise RuntimeError(
            f"{count} {side} workers handled {counts} of {MESSAGES} messages, {left} left"
        )
    return Drain(
        rate=MESSAGES / (finished - started),
        usage=usage,
        smallest_share=min(counts) / MESSAGES,
        stop_seconds=max(stops),
    )


async def fill(channel: AbstractChannel, sample: AbstractIncomingMessage, count: int) -> None:
    """Publish `count` copies of `sample` to the queue, persistent and confirmed.

    The broker's own headers (`x-delivery-count`, which a quorum queue adds) are left out.
    """
    exchange = channel.default_exchange
    numbers = itertools.count()
    headers = {key: value for key, value in sample.headers.items() if not key.startswith("x-")}

    async def publisher() -> None:
        while (n := next(numbers)) < count:
            message_id = f"{sample.message_id}-{n}"
            copy = aio_pika.Message(
                sample.body,
                headers=headers,
                content_type=sample.content_type,
                message_id=message_id,
                correlation_id=message_id,
                type=sample.type,
                reply_to=sample.reply_to,
                timestamp=sample.timestamp,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await exchange.publish(copy, routing_key=QUEUE, mandatory=True)

    await asyncio.gather(*(publisher() for _ in range(min(FILL_IN_FLIGHT, count))))
    waiting = await depth(channel, QUEUE)
    if waiting != count:
        raise RuntimeError(f"{waiting} messages wait in {QUEUE!r} after filling it with {count}")


async def depth(channel: AbstractChannel, queue: str) -> int:
    """How many messages wait in `queue` (ready ones, not those delivered and unacked)."""
    declared = await channel.declare_queue(queue, passive=True)
    return declared.declaration_result.message_count or 0


@dataclass
class Usage:
    """What a phase took of the machine."""

    busy: float
    """The share of all cores busy (every process on the machine)."""
    broker: float
    """The broker's CPU seconds."""
    processes: float
    """The CPU seconds of the phase's worker or relay processes."""


class Watch:
    """From its making: the cores' busy share, and the CPU time of the broker and of `pids`."""

    def __init__(self, broker: int | None, pids: Sequence[int]) -> None:
        self.cores = CoreClock()
        self.broker = ProcessClock([] if broker is None else [broker])
        self.processes = ProcessClock(pids)

    def usage(self) -> Usage:
        """What was used since the watch was made."""
        return Usage(self.cores.busy(), self.broker.seconds(), self.processes.seconds())


class ProcessClock:
    """The CPU seconds some processes spent since it was made, from /proc (NaN if unreadable)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.start = process_cpu(self.pids)

    def seconds(self) -> float:
        """Their CPU seconds (user and system) since the clock was made."""
        end = process_cpu(self.pids)
        if self.start is None or end is None:
            return math.nan
        return end - self.start


def process_cpu(pids: Sequence[int]) -> float | None:
    """The CPU seconds the processes `pids` spent so far; None for none, or off Linux."""
    if not pids:
        return None
    ticks = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


async def broker_pid() -> int | None:
    """The RabbitMQ server's OS process id, from `rabbitmqctl eval`; None if it cannot tell."""
    command = shutil.which("rabbitmqctl", path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if command is None:
        return None
    process = await asyncio.create_subprocess_exec(
        command,
        "-q",
        "eval",
        "os:getpid().",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    output, _ = await process.communicate()
    try:
        return int(output.decode().strip().strip('"'))
    except ValueError:
        return None


class CoreClock:
    """The share of all cores busy since it was made, from /proc/stat (NaN where there is none)."""

    def __init__(self) -> None:
        self.start = cpu_times()

    def busy(self) -> float:
        """The busy share of the cores' time since the clock was made."""
        end = cpu_times()
        if self.start is None or end is None:
            return math.nan
        total = end[0] - self.start[0]
        idle = end[1] - self.start[1]
        return (total - idle) / total if total else math.nan


def cpu_times() -> tuple[int, int] | None:
    """The machine's total and idle (idle + iowait) CPU ticks so far; None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[3] + fields[4]  # guest time is already in user time


# Child processes.


class Child:
    """One child process and what it said: `count` lines are tallied, the others queued."""

    def __init__(self, process: asyncio.subprocess.Process, changed: asyncio.Event) -> None:
        self.process = process
        self.count = 0
        self.last = 0.0
        """When it handled its last message (`time.monotonic()`)."""
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.changed = changed
        """Set whenever its count moves."""
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode().strip()
            if line.startswith("count "):
                _, count, last = line.split()
                self.count, self.last = int(count), float(last)
                self.changed.set()
            else:
                await self.lines.put(line)
        await self.lines.put("")  # end of output

    async def expect(self, word: str) -> str:
        """Its next line other than a count, which must start with `word`."""
        async with asyncio.timeout(60):
            line = await self.lines.get()
        if not line.startswith(word):
            raise RuntimeError(f"child {self.process.pid} said {line!r}, not {word!r}")
        return line

    async def tell(self, word: str) -> None:
        """Write `word` as a line to its stdin."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{word}\n".encode())
        await self.process.stdin.drain()


class Children:
    """`count` processes of `python -m MODULE ARGS`, started on entry, killed on exit if need be."""

    def __init__(
        self, count: int, module: str, *args: str, environment: dict[str, str] | None = None
    ) -> None:
        self.command = (sys.executable, "-m", module, *args)
        self.number = count
        self.environment = environment
        self.children: list[Child] = []
        self.changed = asyncio.Event()

    async def __aenter__(self) -> Children:
        try:
            for _ in range(self.number):
                process = await asyncio.create_subprocess_exec(
                    *self.command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    cwd=ROOT,
                    env=self.environment,
                )
                self.children.append(Child(process, self.changed))
        except BaseException:
            await self.kill()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.kill()

    @property
    def pids(self) -> list[int]:
        """Their process ids."""
        return [child.process.pid for child in self.children]

    async def ready(self) -> None:
        """Until each has said `ready` (imported, connected, waiting for `go`)."""
        for child in self.children:
            await child.expect("ready")

    async def tell(self, word: str) -> None:
        """Say `word` to every child, one right after another."""
        for child in self.children:
            await child.tell(word)

    async def counted(self, expected: int) -> float:
        """Once their counts add up to `expected`: when the last message was handled."""
        try:
            async with asyncio.timeout(PHASE_TIMEOUT):
                while True:
                    self.changed.clear()
                    if sum(child.count for child in self.children) >= expected:
                        break
                    await self.changed.wait()
        except TimeoutError:
            counts = [child.count for child in self.children]
            raise TimeoutError(
                f"the workers handled {counts} of {expected} messages within {PHASE_TIMEOUT:g}s"
            ) from None
        return max(child.last for child in self.children)

    async def stop(self) -> None:
        """Tell each to stop and wait for it to exit (a `RuntimeError` past `STOP_TIMEOUT`)."""
        await self.tell("stop")
        for child in self.children:
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await child.process.wait()
            except TimeoutError:
                raise RuntimeError(
                    f"child {child.process.pid} did not stop within {STOP_TIMEOUT:g}s"
                ) from None

    async def kill(self) -> None:
        """Kill those still running, and wait for them and their readers."""
        for child in self.children:
            if child.process.returncode is None:
                child.process.kill()
            await child.process.wait()
            await asyncio.gather(child.reader, return_exceptions=True)


# The worker processes.


class Counter:
    """The messages a worker process handled, and when the last one was."""

    def __init__(self) -> None:
        self.count = 0
        self.last = 0.0

    def record(self) -> None:
        """Count one message, handled now."""
        self.count += 1
        self.last = time.monotonic()

    async def report(self) -> None:
        """Print `count N LAST` every `REPORT_INTERVAL` while the count moves (until cancelled),
        LAST being when the last message was handled."""
        reported = 0
        while True:
            await asyncio.sleep(REPORT_INTERVAL)
            if self.count != reported:
                reported = self.count
                print(self.line(), flush=True)

    def line(self) -> str:
        """The count report."""
        return f"count {self.count} {self.last:.6f}"


async def serve(
    counter: Counter, start: Callable[[], Awaitable[Any]], stop: Callable[[], Awaitable[Any]]
) -> None:
    """`ready`, then `start()` on `go`, counts until `stop`, then `stop()`, a last count and
    `stopped SECONDS` (how long `stop()` took)."""
    print("ready", flush=True)
    await read_line("go")
    await start()
    reporter = asyncio.create_task(counter.report())
    try:
        await read_line("stop")
    finally:
        reporter.cancel()
        stopping = time.monotonic()
        await stop()
    print(counter.line(), flush=True)
    print(f"stopped {time.monotonic() - stopping:.6f}", flush=True)


async def read_line(word: str) -> None:
    """Until a line arrives on stdin; a `RuntimeError` unless it is `word` (EOF counts as stop)."""
    line = (await asyncio.to_thread(sys.stdin.readline)).strip()
    if line != word and not (word == "stop" and line == ""):
        raise RuntimeError(f"expected {word!r} on stdin, not {line!r}")


async def app_worker(url: str) -> None:
    """A child process: an App on the queue with a counting handler, connected before `go`."""
    counter = Counter()
    app = App(QUEUE, transport=url)

    async def count(message: Tick) -> None:
        counter.record()

    app.register(Tick, count)
    app.route(Tick, QUEUE)  # Ticks arrive in its own queue (else App.start warns they may not)
    await app.transport.start()  # connected now; App.start on `go` declares and consumes
    try:
        await serve(counter, app.start, app.stop)
    finally:
        await app.transport.stop()


async def raw_worker(url: str) -> None:
    """A child process: an aio-pika consumer with the App's prefetch, decoding and acking."""
    counter = Counter()
    decoder = msgspec.json.Decoder(Tick)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue: AbstractQueue = await channel.declare_queue(QUEUE, passive=True)

        async def receive(message: AbstractIncomingMessage) -> None:
            decoder.decode(message.body)
            await message.ack()
            counter.record()

        async def start() -> None:
            await queue.consume(receive, no_ack=False)

        await serve(counter, start, connection.close)
    finally:
        await connection.close()


# Relay processes on one outbox table.


@dataclass
class Relaying:
    """How a set of relay processes emptied the outbox."""

    rate: float
    """Rows per second, from the commit to an empty outbox."""
    usage: Usage
    """What the drain took of the machine; `processes` are the relays."""
    smallest_share: float
    """The share of the rows the least busy relay published."""
    duplicates: int
    missing: int


async def relays_one_and_two(
    url: str, broker: int | None, *, two_first: bool
) -> dict[int, Relaying]:
    """One relay process, then two (or the other way round), each emptying `RELAY_ROWS` rows."""
    async with private_database() as database:
        engine = make_engine(database)
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel()
            sink = await channel.declare_queue(
                RELAY_SINK, durable=True, arguments={"x-queue-type": "classic"}
            )
            phases: dict[int, Relaying] = {}
            for count in (2, 1) if two_first else (1, 2):
                phases[count] = await relaying(database, url, broker, engine, channel, count)
                await sink.purge()
                await vacuum(engine)
            return phases
        finally:
            await connection.close()
            await engine.dispose()


async def relaying(
    database: str,
    url: str,
    broker: int | None,
    engine: AsyncEngine,
    channel: AbstractChannel,
    count: int,
) -> Relaying:
    """`count` relay processes up, then `RELAY_ROWS` rows committed at once; time the drain."""
    environment = {**os.environ, "MERSAL_DATABASE": database, "MERSAL_TRANSPORT": url}
    tables = make_tables()
    rows = [twin_row(RELAY_SINK) for _ in range(RELAY_ROWS)]
    async with Children(
        count, "bench.outbox", "relay-instance", RELAY_APP, environment=environment
    ) as relays:
        async with engine.begin() as connection:  # one transaction: one NOTIFY wakes them all
            await write_outbox(connection, tables.outbox, RELAY_APP, rows, tables.channel)
            await relays.ready()  # the rows are written meanwhile, and committed once all are up
        watch = Watch(broker, relays.pids)
        started = time.monotonic()
        async with asyncio.timeout(PHASE_TIMEOUT):
            await drained(engine, RELAY_APP)
        finished = time.monotonic()
        usage = watch.usage()
        await asyncio.sleep(RELAY_GRACE)
        await relays.stop()
        published = [int((await child.expect("published")).split()[1]) for child in relays.children]
    arrived = await depth(channel, RELAY_SINK)
    return Relaying(
        rate=RELAY_ROWS / (finished - started),
        usage=usage,
        smallest_share=min(published) / RELAY_ROWS,
        duplicates=max(0, arrived - RELAY_ROWS),
        missing=max(0, RELAY_ROWS - arrived),
    )


async def vacuum(engine: AsyncEngine) -> None:
    """VACUUM the outbox, so that the next phase does not step over the last one's dead rows."""
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as connection:
        await connection.execute(text("VACUUM ANALYZE mersal_outbox"))


def main(argv: Sequence[str]) -> int:
    """`app-worker URL` or `raw-worker URL`: a worker process of the benchmark."""
    workers = {"app-worker": app_worker, "raw-worker": raw_worker}
    if len(argv) == 2 and argv[0] in workers:
        loop.run(workers[argv[0]](argv[1]))
        return 0
    print("usage: python -m bench.scaleout app-worker URL | raw-worker URL", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
