"""Messages per second through an App on `memory://`, against a bare asyncio.Queue + msgspec."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgspec

from mersal import App

MESSAGES = 20_000
NOTE = "a small note"


@dataclass
class Ping:
    """The benchmark's message: small, like most commands and events."""

    n: int
    note: str


async def run() -> dict[str, float | int]:
    """Time the framework and the raw baseline on the same work, in the same loop."""
    framework = await through_app(MESSAGES)
    raw = await through_queue(MESSAGES)
    return {
        "inmemory_msgs_per_s": MESSAGES / framework,
        "inmemory_us_per_msg": framework / MESSAGES * 1e6,
        "raw_queue_msgs_per_s": MESSAGES / raw,
        "inmemory_ratio_to_raw": raw / framework,
    }


async def through_app(count: int) -> float:
    """Seconds from the first send until the handler has seen all `count` messages."""
    app = App(f"bench-{uuid.uuid4().hex[:8]}", transport=f"memory://bench-{uuid.uuid4().hex}")
    done = asyncio.Event()
    seen = 0

    async def handle(message: Ping) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()

    app.register(Ping, handle)
    app.route(Ping, app.name)
    async with app:
        started = time.perf_counter()
        for n in range(count):
            await app.send(Ping(n, NOTE))
        await asyncio.wait_for(done.wait(), timeout=120)
        elapsed = time.perf_counter() - started
    return elapsed


async def through_queue(count: int) -> float:
    """The same work without the framework: encode, queue, decode into the class, count."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    done = asyncio.Event()

    async def consume() -> None:
        seen = 0
        while seen < count:
            body = await queue.get()
            msgspec.json.decode(body, type=Ping)
            seen += 1
        done.set()

    consumer = asyncio.create_task(consume())
    started = time.perf_counter()
    for n in range(count):
        await queue.put(msgspec.json.encode(Ping(n, NOTE)))
    await asyncio.wait_for(done.wait(), timeout=120)
    elapsed = time.perf_counter() - started
    await consumer
    return elapsed
