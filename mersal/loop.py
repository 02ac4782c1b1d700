"""The event loop Mersal's commands run on: uvloop if there (`mersal-bus[fast]`), else asyncio's.

`MERSAL_LOOP` (or `mersal run --loop`) chooses: `auto` (the default: uvloop if it imports),
`uvloop`, or `asyncio`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mersal.errors import ConfigurationError

T = TypeVar("T")

LOOPS = ("auto", "uvloop", "asyncio")
"""The choices of loop."""


def chosen(choice: str | None = None) -> str:
    """The loop `choice` (else `MERSAL_LOOP`, else auto) comes to: 'uvloop' or 'asyncio'."""
    choice = (choice or os.environ.get("MERSAL_LOOP") or "auto").strip().lower()
    if choice not in LOOPS:
        raise ConfigurationError(f"loop {choice!r} is not one of {', '.join(LOOPS)}")
    if choice == "asyncio":
        return "asyncio"
    if _uvloop_factory() is None:
        if choice == "uvloop":
            raise ConfigurationError(
                "the uvloop loop was asked for but uvloop is not installed: "
                "pip install 'mersal-bus[fast]', or choose the asyncio loop"
            ) from None
        return "asyncio"
    return "uvloop"


def factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A new-loop function for `asyncio.Runner`: uvloop's, or None for asyncio's own."""
    return None if chosen(choice) == "asyncio" else _uvloop_factory()


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str | None = None) -> T:
    """Run `main` to its end on a new loop of the chosen kind, like `asyncio.run`."""
    try:
        loop_factory = factory(choice)
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)
