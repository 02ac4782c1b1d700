"""What an app still waits for, in words: for `Harness.idle`'s timeout and a graceful stop's log."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Sequence

from mersal.messages import Envelope, Header, TypeRegistry, shown
from mersal.outbox import Storage
from mersal.worker import Worker

PENDING_WAIT = 1.0
"""Seconds to wait for the outbox's count of pending rows before leaving it out."""


def type_of(types: TypeRegistry, envelope: Envelope) -> str:
    """The message's class name if the app knows its type, else its wire type name."""
    name = envelope.headers.get(Header.TYPE, "")
    cls = types.known(name)
    return cls.__qualname__ if cls is not None else shown(name) or "a message without a type"


def tally(names: Iterable[str]) -> str:
    """`Ping x2, Pong`: each name once, with how often it came when more than once."""
    return ", ".join(_counted(name, n) for name, n in Counter(names).items())


def _counted(name: str, n: int) -> str:
    return name if n == 1 else f"{name} x{n}"


def plural(count: int, noun: str) -> str:
    """`1 handler`, `3 handlers`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def seconds(value: float) -> str:
    """Seconds with one decimal: `4.9 s`."""
    return f"{value:.1f} s"


def running_handlers(types: TypeRegistry, worker: Worker | None) -> list[tuple[str, float]]:
    """The message type of each handler running now in `worker`, with the seconds it has run."""
    if worker is None:
        return []
    return [(type_of(types, delivery.envelope), taken) for delivery, taken in worker.handling()]


def with_times(running: Sequence[tuple[str, float]]) -> str:
    """`Ping x2 (4.9 s), Pong (0.1 s)`: each type, how many, the longest one's seconds."""
    longest: dict[str, float] = {}
    for name, taken in running:
        longest[name] = max(taken, longest.get(name, 0.0))
    counted = Counter(name for name, _ in running)
    return ", ".join(
        f"{_counted(name, n)} ({seconds(longest[name])})" for name, n in counted.items()
    )


async def stopping(
    name: str, grace_period: float, running: Sequence[tuple[str, float]], storage: Storage | None
) -> str:
    """What a graceful stop of app `name` is about to wait for, and for how long at most."""
    waits = []
    if running:
        which = tally(name for name, _ in running)
        waits.append(
            f"up to {grace_period:g} s for {plural(len(running), 'handler')} in flight ({which})"
        )
    rows = await pending_rows(storage) if storage is not None and storage.relay else 0
    drain = getattr(storage, "drain_timeout", None)  # the SQL storage's; others: unbounded
    left = ""
    if rows and drain is not None and not drain > 0:
        left = f"; {plural(rows, 'outbox row')} pending wait for the next start (drain_timeout=0)"
    elif rows:
        bound = "" if drain is None else f"up to {drain:g} s "
        waits.append(f"{bound}for the outbox relay ({plural(rows, 'row')} pending)")
    if not waits:
        return f"stopping app {name!r}: nothing in flight{left}"
    return f"stopping app {name!r}: waiting {' and then '.join(waits)}{left}"


def stopped(name: str, grace_period: float, took: float, unfinished: int) -> str:
    """How a graceful stop of app `name` ended: everything done, or what it gave up on."""
    if not unfinished:
        return f"app {name!r} stopped in {seconds(took)}"
    return (
        f"app {name!r} stopped in {seconds(took)}: gave up after {grace_period:g} s "
        f"with {plural(unfinished, 'handler')} still running; their messages go back to the "
        "queue and will be redelivered"
    )


async def pending_rows(storage: Storage | None) -> int:
    """The outbox rows not yet sent; 0 without a storage, or one that does not answer soon."""
    if storage is None:
        return 0
    try:
        async with asyncio.timeout(PENDING_WAIT):
            return await storage.pending()
    except Exception:  # a database that does not answer: the rest of the text still helps
        return 0
