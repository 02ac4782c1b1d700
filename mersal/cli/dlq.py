"""`mersal dlq list|show|replay|drop`: an error queue, looked at and repaired through the transport.

The messages are taken and given back as `mersal.dead_letters.DeadLetters` does it: listing and
showing leave every message in the queue; replaying and dropping ask first where they must.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mersal.app import App
from mersal.cli.helpers import ProgressLine, in_process, load_app, positive_int
from mersal.dead_letters import (
    SUMMARY_COLUMNS,
    DeadLetter,
    DeadLetters,
    MissingQueue,
    details,
    summary,
)
from mersal.errors import ConfigurationError
from mersal.loop import in_daemon_thread
from mersal.plugins import transport_from
from mersal.text import align
from mersal.urls import mask

DLQ_LIST_LIMIT = 100
"""The messages `mersal dlq list` looks at, by default."""
DLQ_SCAN_LIMIT = 1_000
"""The messages `mersal dlq show|replay|drop` look among, by default."""


def add_dlq_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `dlq list|show|replay|drop` to the `mersal` command's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--app",
        default=None,
        metavar="MODULE:APP",
        help="the app whose error queue and broker to use (--queue and --transport win)",
    )
    common.add_argument(
        "--transport",
        default=None,
        metavar="URL",
        help="the broker URL (default: the --app's, else $MERSAL_TRANSPORT)",
    )
    common.add_argument(
        "--queue",
        default=None,
        metavar="NAME",
        help="the error queue (default: the --app's, else error)",
    )
    scanning = argparse.ArgumentParser(add_help=False)
    scanning.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        default=DLQ_SCAN_LIMIT,
        help=f"look among the first N messages ({DLQ_SCAN_LIMIT})",
    )
    dlq = commands.add_parser("dlq", help="look at, replay and drop the messages in an error queue")
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
        "show", parents=[common, scanning], help="every header and the body of a message; it stays"
    )
    show.add_argument("message_id", help="the message's id (from `mersal dlq list`)")
    show.set_defaults(handler=dead_letters_command(dlq_show))
    replay = actions.add_parser(
        "replay",
        parents=[common, scanning],
        help="send messages back to the queue they failed in, with a fresh set of retries",
    )
    replay.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID", help="the messages")
    replay.add_argument("--all", action="store_true", help="every message (up to --limit)")
    replay.add_argument(
        "--to", default=None, metavar="QUEUE", help="send them here instead of their source queue"
    )
    replay.set_defaults(handler=dead_letters_command(dlq_replay))
    drop = actions.add_parser(
        "drop",
        parents=[common, scanning],
        help="remove messages from the error queue for good (asks first)",
    )
    drop.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID", help="the messages")
    drop.add_argument(
        "--type",
        dest="type_name",
        default=None,
        metavar="NAME",
        help="the messages of this type (its type header)",
    )
    drop.add_argument(
        "--error",
        default=None,
        metavar="TEXT",
        help="the messages with TEXT in their error type or error message",
    )
    drop.add_argument("--all", action="store_true", help="every message (up to --limit)")
    drop.add_argument(
        "--yes", action="store_true", help="drop without asking (needed when stdin is no terminal)"
    )
    drop.set_defaults(handler=dead_letters_command(dlq_drop))


DeadLettersAction = Callable[[DeadLetters, argparse.Namespace], Awaitable[int]]
"""What a `mersal dlq` command does with the error queue: its exit status."""


def dead_letters_command(action: DeadLettersAction) -> Callable[[argparse.Namespace], int]:
    """A command handler running `action` on the error queue over a transport of its own."""

    def run(args: argparse.Namespace) -> int:
        app = load_app(args.app) if args.app else None
        url = dlq_url(args, app)
        queue = args.queue or (app.retry.error_queue if app is not None else "error")
        try:
            return asyncio.run(with_dead_letters(url, queue, args, action))
        except MissingQueue as error:
            raise ConfigurationError(missing_queue(error, url, args, app)) from None
        except KeyboardInterrupt:
            print(
                f"\nmersal: interrupted; every message not yet replayed or dropped is back in "
                f"{queue!r}",
                file=sys.stderr,
            )
            return 130

    return run


async def with_dead_letters(
    url: str, queue: str, args: argparse.Namespace, action: DeadLettersAction
) -> int:
    """Start a transport for `url`, run `action` on `queue`, stop the transport."""
    transport = transport_from(url)
    await transport.start()
    try:
        return await action(DeadLetters(transport, queue), args)
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
        print(details(letter))
    return 0


async def dlq_replay(dead_letters: DeadLetters, args: argparse.Namespace) -> int:
    """`mersal dlq replay`: send messages back, ack each once sent; print what went where."""
    if bool(args.message_ids) == bool(args.all):
        raise ConfigurationError("mersal dlq replay needs message ids or --all (not both)")
    wanted = None if args.all else set(args.message_ids)
    with ProgressLine("replayed") as progress:
        replays = await dead_letters.replay(wanted, to=args.to, limit=args.limit, progress=progress)
    queue = dead_letters.queue
    for replay in replays:
        name = replay.letter.message_id or "(no id)"
        if replay.sent:
            print(f"replayed {name} ({replay.letter.type_name or '-'}) to {replay.queue!r}")
        if not replay.done:
            print(f"mersal: {name}: {replay.problem}", file=sys.stderr)
    missing = not_found(wanted, {replay.letter.message_id for replay in replays}, args.limit, queue)
    sent = sum(replay.sent for replay in replays)
    print(f"replayed {sent} of {len(replays) + len(missing)} message(s) from {queue!r}")
    return 0 if all(replay.done for replay in replays) and not missing else 1


async def dlq_drop(dead_letters: DeadLetters, args: argparse.Namespace) -> int:
    """`mersal dlq drop`: remove the chosen messages for good once confirmed; print which."""
    if [bool(args.message_ids), bool(args.type_name or args.error), args.all].count(True) != 1:
        raise ConfigurationError(
            "mersal dlq drop needs message ids, --type/--error, or --all (one of them)"
        )
    if not args.yes and not sys.stdin.isatty():
        raise ConfigurationError(
            "mersal dlq drop asks before it drops, and stdin is not a terminal: pass --yes "
            "to drop without asking"
        )
    queue = dead_letters.queue
    declined = False

    async def confirm(letters: Sequence[DeadLetter]) -> bool:
        nonlocal declined
        declined = not await ask_to_drop(letters, queue)
        return not declined

    wanted = set(args.message_ids) if args.message_ids else None
    with ProgressLine("dropped") as progress:
        drops = await dead_letters.drop(
            wanted,
            type_name=args.type_name or None,
            error=args.error or None,
            limit=args.limit,
            confirm=None if args.yes else confirm,
            progress=progress,
        )
    if declined:
        print(f"nothing dropped from {queue!r}")
        return 2
    for drop in drops:
        name = drop.letter.message_id or "(no id)"
        if drop.done:
            print(f"dropped {name} ({drop.letter.type_name or '-'})")
        else:
            print(f"mersal: {name}: {drop.problem}", file=sys.stderr)
    missing = not_found(wanted, {drop.letter.message_id for drop in drops}, args.limit, queue)
    dropped = sum(drop.done for drop in drops)
    print(f"dropped {dropped} of {len(drops) + len(missing)} message(s) from {queue!r}")
    return 0 if dropped == len(drops) and not missing else 1


def not_found(wanted: set[str] | None, found: set[str | None], limit: int, queue: str) -> list[str]:
    """The wanted ids not found, each named on stderr."""
    missing = sorted((wanted or set()) - found)
    for message_id in missing:
        print(
            f"mersal: no message {message_id!r} among the first {limit} in {queue!r}",
            file=sys.stderr,
        )
    return missing


DROP_PREVIEW = 10
"""The most messages `mersal dlq drop` lists when it asks."""


async def ask_to_drop(letters: Sequence[DeadLetter], queue: str) -> bool:
    """Show the messages (the first few) on stderr and ask whether to drop them; True for yes."""
    shown = letters[:DROP_PREVIEW]
    for line in align([SUMMARY_COLUMNS, *(summary(letter) for letter in shown)]):
        print(line, file=sys.stderr)
    if len(letters) > len(shown):
        print(f"... and {len(letters) - len(shown)} more", file=sys.stderr)
    answer = await read_answer(f"drop {len(letters)} message(s) from {queue!r}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


async def read_answer(question: str) -> str:
    """Ask `question` on stderr; the line typed on stdin ('' at its end), read off the loop.

    The loop keeps running meanwhile (the broker's heartbeats), and a question left unanswered
    (Ctrl-C) does not keep the process alive.
    """
    print(question, end="", file=sys.stderr, flush=True)
    try:
        line: str = await in_daemon_thread(sys.stdin.readline)
    except (OSError, ValueError):
        return ""
    return line


def dlq_url(args: argparse.Namespace, app: App | None) -> str:
    """The broker's URL: --transport, else the app's, else MERSAL_TRANSPORT."""
    from_app = app.transport.address if app is not None and not args.transport else None
    url = args.transport or from_app or os.environ.get("MERSAL_TRANSPORT")
    if not url:
        raise ConfigurationError(
            f"mersal dlq {args.dlq_command} needs --transport URL or MERSAL_TRANSPORT "
            "(or --app module:app, for the app's broker)"
        )
    if in_process(url):
        where = f"app {app.name!r} is on {mask(url)}," if app and from_app else f"{mask(url)} is"
        raise ConfigurationError(
            f"{where} an in-process broker that only its own process sees: "
            "give the broker's URL (--transport amqp://user:password@host/vhost)"
        )
    return url


def missing_queue(error: MissingQueue, url: str, args: argparse.Namespace, app: App | None) -> str:
    """What to change when the error queue is not there, and where its name came from."""
    if args.queue:
        origin = "from --queue"
    elif app is not None:
        origin = f"the error queue of app {app.name!r}"
    else:
        origin = "the default"
    return (
        f"no queue named {error.queue!r} ({origin}) on {mask(url)}: name the error queue "
        "with --queue NAME, or the app whose error queue to read with --app module:app"
    )
