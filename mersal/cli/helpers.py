"""What every `mersal` subcommand uses, ours and adapters': the app named, argument types, progress.

An adapter's commands (`mersal.commands` entry points) import them from `mersal.cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import math
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TextIO

from mersal.app import App
from mersal.errors import ConfigurationError, MersalError


def load_app(target: str) -> App:
    """The App named by `module:attribute` (an App, or a function returning one).

    An async function's App is made in an event loop of its own: for commands that read the
    app's configuration. `mersal run` awaits it in the loop it serves the app in (`open_app`).
    """
    found, called = find_app(target)
    if not inspect.isawaitable(found):
        return checked_app(target, found, called)
    if _loop_running():
        close = getattr(found, "close", None)
        if callable(close):  # a coroutine never awaited: no warning about it
            close()
        raise ConfigurationError(
            f"{target} is an async function: in a running event loop, "
            f"`await mersal.cli.open_app({target!r})`"
        )
    return asyncio.run(_awaited(target, found))


async def open_app(target: str) -> App:
    """The App named by `module:attribute`, an async function's awaited in the running loop."""
    found, called = find_app(target)
    if inspect.isawaitable(found):
        return await _awaited(target, found)
    return checked_app(target, found, called)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_MISSING = object()


def find_app(target: str) -> tuple[object, bool]:
    """What `module:attribute` (or `module:holder.attribute`) names, called if it is a function;
    and whether it was called.
    """
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"{target!r} is not module:attribute, e.g. 'orders.service:app'")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigurationError(f"cannot import {module_name!r}: {error}") from None
    except Exception as error:  # the user's module failed: one line, not a traceback
        raise ConfigurationError(
            f"importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    found: object = module
    for name in attribute.split("."):  # `module:holder.app` reaches into a class or an object
        found = getattr(found, name, _MISSING)
        if found is _MISSING:
            raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}")
    if isinstance(found, App) or not callable(found):
        return found, False
    try:
        return found(), True
    except MersalError:
        raise
    except Exception as error:
        raise _raised(target, error) from error


async def _awaited(target: str, awaitable: Awaitable[object]) -> App:
    try:
        found = await awaitable
    except MersalError:
        raise
    except Exception as error:
        raise _raised(target, error) from error
    return checked_app(target, found, called=True)


def _raised(target: str, error: Exception) -> ConfigurationError:
    return ConfigurationError(f"{target}() raised {type(error).__name__}: {error}")


def checked_app(target: str, found: object, called: bool) -> App:
    """`found` if it is an App; else a ConfigurationError saying what `target` gave instead."""
    if isinstance(found, App):
        return found
    if inspect.iscoroutine(found):  # an async function that returned another's coroutine
        found.close()
    what = f"{target}() returned" if called else f"{target} is"
    raise ConfigurationError(
        f"{what} {type(found).__qualname__}, not a mersal App: name an App, or a "
        "function (async or not) that returns one"
    )


def in_process(url: str) -> bool:
    """Whether `url` is a `memory://` broker's, which lives in the process that made it."""
    return url.partition("://")[0].lower() == "memory"


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    value = _number_of_seconds(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not 0 or more seconds")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    value = _number_of_seconds(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port number, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535)")
    return value


def _number_of_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


class ProgressLine:
    """`<verb> done/total` on one line of stderr during a long job, if stderr is a terminal.

    Call it with `(done, total)` after each item; leaving its `with` block ends the line.
    Jobs of `after` items or fewer, and streams that are no terminal, get nothing.
    """

    after = 50
    """Jobs of more items than this show their progress."""
    every = 0.1
    """The least seconds between two updates of the line."""

    def __init__(
        self,
        verb: str,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.verb = verb
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.terminal = self.stream.isatty()
        self.shown_at: float | None = None

    def __call__(self, done: int, total: int) -> None:
        """Show that `done` of `total` items are through (the last one always, others throttled)."""
        if not self.terminal or total <= self.after:
            return
        now = self.clock()
        if done < total and self.shown_at is not None and now - self.shown_at < self.every:
            return
        self.shown_at = now
        self.stream.write(f"\r{self.verb} {done}/{total}")
        self.stream.flush()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.shown_at is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.shown_at = None
