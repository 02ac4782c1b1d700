"""The `mersal` command: `mersal run module:app` runs an app's worker until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from mersal.app import App
from mersal.errors import ConfigurationError, MersalError


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="mersal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run an app's worker until SIGINT or SIGTERM")
    run.add_argument("target", help="module:attribute naming an App (or a function returning one)")
    run.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_adapter_commands(commands)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is not None:
        try:
            return int(handler(args))
        except MersalError as error:
            print(f"mersal: {error}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = load_app(args.target)
        asyncio.run(serve(app))
    except MersalError as error:
        print(f"mersal: {error}", file=sys.stderr)
        return 2
    return 0


def add_adapter_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add the commands of the installed adapters (`db` from mersal_sqlalchemy)."""
    try:
        from mersal_sqlalchemy.cli import add_db_commands
    except ImportError:
        return
    add_db_commands(commands)


def load_app(target: str) -> App:
    """The App named by `module:attribute` (an App, or a callable returning one)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"{target!r} is not module:attribute, e.g. 'orders.service:app'")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigurationError(f"cannot import {module_name!r}: {error}") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}")
    if not isinstance(found, App) and callable(found):
        found = found()
    if not isinstance(found, App):
        raise ConfigurationError(f"{target} is {type(found).__qualname__}, not a mersal App")
    return found


async def serve(app: App) -> None:
    """Run `app` until SIGINT or SIGTERM, then stop it gracefully."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    async with app:
        await stopping.wait()


if __name__ == "__main__":
    sys.exit(main())
