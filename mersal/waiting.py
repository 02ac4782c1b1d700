"""What an app still waits for, in words: for `Harness.idle`'s timeout and a graceful stop's log."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mersal.messages import Envelope, Header

if TYPE_CHECKING:
    from mersal.app import App


def type_of(app: App, envelope: Envelope) -> str:
    """The message's class name if the app knows its type, else its wire type name."""
    name = envelope.headers.get(Header.TYPE, "")
    cls = app.types.known(name)
    return cls.__qualname__ if cls is not None else name or "a message without a type"


def tally(names: Iterable[str]) -> str:
    """`Ping x2, Pong`: each name once, with how often it came when more than once."""
    counted = Counter(names)
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counted.items())


def plural(count: int, noun: str) -> str:
    """`1 handler`, `3 handlers`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def seconds(value: float) -> str:
    """Seconds with one decimal: `4.9 s`."""
    return f"{value:.1f} s"


def handlers_running(app: App) -> tuple[int, str]:
    """How many handlers run now in `app`, and `Ping x2 (4.9 s), Pong (0.1 s)` (longest each)."""
    worker = app.worker
    if worker is None:
        return 0, ""
    running = worker.handling()
    longest: dict[str, float] = {}
    names: list[str] = []
    for delivery, taken in running:
        name = type_of(app, delivery.envelope)
        names.append(name)
        longest[name] = max(taken, longest.get(name, 0.0))
    counted = Counter(names)
    parts = [
        f"{name if n == 1 else f'{name} x{n}'} ({seconds(longest[name])})"
        for name, n in counted.items()
    ]
    return len(running), ", ".join(parts)


def and_list(parts: Sequence[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    if len(parts) <= 1:
        return "".join(parts)
    return f"{', '.join(parts[:-1])} and {parts[-1]}"
