"""The `mersal` command: run an app's worker; look at and replay an error queue; adapters' tools.

`mersal run module:app` runs until SIGINT or SIGTERM; `mersal dlq list|show|replay` works on an
error queue through the transport; installed adapters add theirs (`mersal db ...` and
`mersal outbox ...` come with the SQL adapter) through the `mersal.commands` entry points.
"""

# For adapters' commands: `load_app`, `positive_int` and `align` are documented helpers.

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mersal import loop, plugins
from mersal.app import App
from mersal.dead_letters import SUMMARY_COLUMNS, DeadLetters, describe, summary
from mersal.errors import ConfigurationError, MersalError
from mersal.plugins import transport_from
from mersal.transport import mask

DLQ_LIST_LIMIT = 100
DLQ_SCAN_LIMIT = 1_000


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="mersal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run an app's worker until SIGINT or SIGTERM")
    run.add_argument("target", help="module:attribute naming an App (or a function returning one)")
    run.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    run.add_argument(
        "--loop",
        choices=loop.LOOPS,
        default=None,
        help="event loop: uvloop when installed (mersal[fast]), or asyncio's (default: "
        "MERSAL_LOOP, else auto)",
    )
    add_dlq_commands(commands)
    plugins.add_commands(commands)
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
        loop.run(serve(app), args.loop)
    except MersalError as error:
        print(f"mersal: {error}", file=sys.stderr)
        return 2
    return 0


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


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def align(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as lines, each column padded to its widest cell."""
    if not rows:
        return []
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


# mersal dlq list|show|replay


def add_dlq_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `dlq list|show|replay` to the `mersal` command's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--transport",
        default=None,
        metavar="URL",
        help="the broker URL (default: $MERSAL_TRANSPORT)",
    )
    common.add_argument(
        "--queue", default="error", metavar="NAME", help="the error queue (default: error)"
    )
    dlq = commands.add_parser("dlq", help="look at and replay the messages in an error queue")
    actions = dlq.add_subparsers(dest="dlq_command", required=True)
    listing = actions.add_parser(
        "list", parents=[common], help="one line per message; every message stays in the queue"
    )
    listing.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        default=DLQ_LIST_LIMIT,
        help=f"look at the first N messages ({DLQ_LIST_LIMIT})",
    )
    listing.set_defaults(handler=dead_letters_command(dlq_list))
    show = actions.add_parser(
        "show", parents=[common], help="every header and the body of a message; it stays"
    )
    show.add_argument("message_id", help="the message's id (from `mersal dlq list`)")
    show.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        default=DLQ_SCAN_LIMIT,
        help=f"look among the first N messages ({DLQ_SCAN_LIMIT})",
    )
    show.set_defaults(handler=dead_letters_command(dlq_show))
    replay = actions.add_parser(
        "replay",
        parents=[common],
        help="send messages back to the queue they failed in, with a fresh set of retries",
    )
    replay.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID", help="the messages")
    replay.add_argument("--all", action="store_true", help="every message (up to --limit)")
    replay.add_argument(
        "--to", default=None, metavar="QUEUE", help="send them here instead of their source queue"
    )
    replay.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        default=DLQ_SCAN_LIMIT,
        help=f"look among the first N messages ({DLQ_SCAN_LIMIT})",
    )
    replay.set_defaults(handler=dead_letters_command(dlq_replay))


DeadLettersAction = Callable[[DeadLetters, argparse.Namespace], Awaitable[int]]


def dead_letters_command(action: DeadLettersAction) -> Callable[[argparse.Namespace], int]:
    """A command handler running `action` on the error queue over a transport of its own."""

    def run(args: argparse.Namespace) -> int:
        url = args.transport or os.environ.get("MERSAL_TRANSPORT")
        if not url:
            raise ConfigurationError(
                f"mersal dlq {args.dlq_command} needs --transport URL or MERSAL_TRANSPORT"
            )
        if url.partition("://")[0].lower() == "memory":
            raise ConfigurationError(
                f"{mask(url)} is an in-process broker that only its own process sees: "
                "give the broker's URL (amqp://user:password@host/vhost)"
            )
        return asyncio.run(with_dead_letters(url, args, action))

    return run


async def with_dead_letters(url: str, args: argparse.Namespace, action: DeadLettersAction) -> int:
    """Start a transport for `url`, run `action` on `args.queue`, stop the transport."""
    transport = transport_from(url)
    await transport.start()
    try:
        return await action(DeadLetters(transport, args.queue), args)
    finally:
        await transport.stop()


async def dlq_list(dead_letters: DeadLetters, args: argparse.Namespace) -> int:
    """`mersal dlq list`: a line per message, all returned to the queue."""
    letters = await dead_letters.peek(args.limit)
    queue = dead_letters.queue
    if not letters:
        print(f"no messages in {queue!r}")
        return 0
    for line in align([SUMMARY_COLUMNS, *(summary(letter) for letter in letters)]):
        print(line)
    more = f" (the first {args.limit}: --limit N for more)" if len(letters) == args.limit else ""
    print(f"{len(letters)} message(s) in {queue!r}{more}, all left there")
    return 0


async def dlq_show(dead_letters: DeadLetters, args: argparse.Namespace) -> int:
    """`mersal dlq show`: every header and the body of a message, which stays in the queue."""
    letters = await dead_letters.find({args.message_id}, limit=args.limit)
    queue = dead_letters.queue
    if not letters:
        print(
            f"mersal: no message {args.message_id!r} among the first {args.limit} in {queue!r}",
            file=sys.stderr,
        )
        return 1
    for number, letter in enumerate(letters):
        if number:
            print()
        print(f"message {args.message_id} in {queue!r}:")
        print(describe(letter))
    return 0


async def dlq_replay(dead_letters: DeadLetters, args: argparse.Namespace) -> int:
    """`mersal dlq replay`: send messages back, ack each once sent; print what went where."""
    if bool(args.message_ids) == bool(args.all):
        raise ConfigurationError("mersal dlq replay needs message ids or --all (not both)")
    wanted = None if args.all else set(args.message_ids)
    replays = await dead_letters.replay(wanted, to=args.to, limit=args.limit)
    queue = dead_letters.queue
    for replay in replays:
        name = replay.letter.message_id or "(no id)"
        if replay.sent:
            print(f"replayed {name} ({replay.letter.type_name or '-'}) to {replay.queue!r}")
        if not replay.done:
            print(f"mersal: {name}: {replay.problem}", file=sys.stderr)
    missing = sorted((wanted or set()) - {r.letter.message_id for r in replays})
    for message_id in missing:
        print(
            f"mersal: no message {message_id!r} among the first {args.limit} in {queue!r}",
            file=sys.stderr,
        )
    sent = sum(replay.sent for replay in replays)
    print(f"replayed {sent} of {len(replays) + len(missing)} message(s) from {queue!r}")
    return 0 if all(replay.done for replay in replays) and not missing else 1


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
