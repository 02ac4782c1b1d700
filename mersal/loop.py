"""The event loop Mersal's commands run on: uvloop if there (`mersal-bus[fast]`), else asyncio's.

`MERSAL_LOOP` (or `mersal run --loop`) chooses: `auto` (the default: uvloop if it imports),
`uvloop`, or `asyncio`. A blocking call that may never return runs off it, `in_daemon_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
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


async def in_daemon_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a daemon thread: a caller that stops waiting does not wait for it.

    (`asyncio.to_thread` cannot be abandoned: `asyncio.run` waits for its threads at the end.)
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as error:  # handed to the caller, who raises it
            answer: Callable[[], None] = functools.partial(done.set_exception, error)
        else:
            answer = functools.partial(done.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, answer)

    threading.Thread(target=run, name="mersal-command", daemon=True).start()
    return await done
