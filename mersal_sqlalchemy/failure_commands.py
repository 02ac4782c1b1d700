"""`mersal failures ingest|groups|list|show|retry|delete`: the dead-letter store, as commands.

`ingest` moves what is in the error queue into the store (acked once stored); the others work
on the table alone, except `retry`, whose outbox rows this command also sends when it knows the
broker (the app's own relay sends them otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from mersal.app import App
from mersal.cli import align, load_app, positive_int
from mersal.dead_letters import DeadLetters, body_text
from mersal.errors import ConfigurationError
from mersal.outbox import Relay
from mersal.plugins import transport_from
from mersal.text import first_line, iso
from mersal.transport import Transport
from mersal.urls import mask
from mersal_sqlalchemy.dead_letters import INGEST_BATCH, PAGE, DeadLetterStore, StoredFailure
from mersal_sqlalchemy.engines import database_url, make_engine
from mersal_sqlalchemy.outbox import SqlOutboxStore
from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, make_tables

LIST_COLUMNS = ("ID", "MESSAGE-ID", "TYPE", "ERROR", "ATTEMPTS", "SOURCE", "FAILED-AT", "MESSAGE")
GROUP_COLUMNS = ("GROUP", "COUNT", "FIRST-SEEN", "LAST-SEEN", "FAILURE")


@dataclass(frozen=True)
class Target:
    """Whose store: the app's name, its database, and (where known) its broker and error queue."""

    name: str
    database: str
    transport: str | None
    queue: str


def add_failure_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `failures ingest|groups|list|show|retry|delete` to the `mersal` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--app", default=None, metavar="MODULE:APP", help="the app (its database)")
    common.add_argument("--name", default=None, help="the app's name, without --app")
    common.add_argument("--database", default=None, metavar="URL", help="default: $MERSAL_DATABASE")
    common.add_argument("--transport", default=None, metavar="URL", help="the broker URL")
    common.add_argument("--queue", default=None, metavar="NAME", help="the error queue (error)")
    common.add_argument("--outbox-table", default=DEFAULT_OUTBOX, metavar="NAME")
    common.add_argument("--inbox-table", default=DEFAULT_INBOX, metavar="NAME")
    failures = commands.add_parser(
        "failures", help="the dead-letter store: ingest the error queue, group, retry, delete"
    )
    actions = failures.add_subparsers(dest="failures_command", required=True)
    ingest = actions.add_parser(
        "ingest", parents=[common], help="move the error queue's messages into the store"
    )
    ingest.add_argument("--batch", type=positive_int, default=INGEST_BATCH, metavar="N")
    ingest.add_argument("--follow", action="store_true", help="keep ingesting until stopped")
    ingest.set_defaults(handler=store_command(failures_ingest))
    groups = actions.add_parser("groups", parents=[common], help="the failure groups, with counts")
    groups.set_defaults(handler=store_command(failures_groups))
    listing = actions.add_parser("list", parents=[common], help="stored failures, newest first")
    listing.add_argument("--group", default=None, help="only this group (a key from `groups`)")
    listing.add_argument("--search", default=None, help="text in the id, type or error")
    listing.add_argument("--limit", type=positive_int, default=PAGE, metavar="N")
    listing.set_defaults(handler=store_command(failures_list))
    show = actions.add_parser("show", parents=[common], help="a failure's headers, body, traceback")
    show.add_argument("id", type=int, help="the failure's id (from `list`)")
    show.set_defaults(handler=store_command(failures_show))
    retry = actions.add_parser(
        "retry", parents=[common], help="send failures back to their queues (through the outbox)"
    )
    retry.add_argument("ids", nargs="*", type=int, metavar="ID")
    retry.add_argument("--group", default=None, help="every failure of this group")
    retry.set_defaults(handler=store_command(failures_retry))
    delete = actions.add_parser("delete", parents=[common], help="remove failures for good")
    delete.add_argument("ids", nargs="*", type=int, metavar="ID")
    delete.add_argument("--group", default=None, help="every failure of this group")
    delete.set_defaults(handler=store_command(failures_delete))


StoreAction = Callable[[DeadLetterStore, Target, argparse.Namespace], Awaitable[int]]
"""What a `mersal failures` command does with the store: its exit status."""


def store_command(action: StoreAction) -> Callable[[argparse.Namespace], int]:
    """A command handler running `action` on the store through a short-lived engine."""

    def run(args: argparse.Namespace) -> int:
        target = target_of(args)
        try:
            return asyncio.run(with_store(target, args, action))
        except KeyboardInterrupt:
            print("\nmersal: interrupted; what was committed stays done", file=sys.stderr)
            return 130

    return run


def target_of(args: argparse.Namespace) -> Target:
    """Whose store the command works on, from --app or from --name and --database."""
    app: App | None = load_app(args.app) if args.app else None
    name = args.name or (app.name if app is not None else None)
    database = (
        args.database
        or (app.settings.database if app is not None else None)
        or os.environ.get("MERSAL_DATABASE")
    )
    if not name or not database:
        raise ConfigurationError(
            f"mersal failures {args.failures_command} needs --app module:app (an app with a "
            "database), or --name APP with --database URL (or MERSAL_DATABASE)"
        )
    transport = args.transport or (app.transport.address if app is not None else None)
    transport = transport or os.environ.get("MERSAL_TRANSPORT")
    queue = args.queue or (app.retry.error_queue if app is not None else "error")
    return Target(name, database, transport, queue)


async def with_store(target: Target, args: argparse.Namespace, action: StoreAction) -> int:
    """Run `action` on the target's store, disposing of the engine afterwards."""
    engine = make_engine(database_url(target.database))
    tables = make_tables(args.outbox_table, args.inbox_table)
    try:
        return await action(DeadLetterStore(engine, tables, target.name), target, args)
    finally:
        await engine.dispose()


@asynccontextmanager
async def broker(target: Target, what: str) -> AsyncIterator[Transport]:
    """A started transport on the target's broker."""
    if not target.transport:
        raise ConfigurationError(
            f"mersal failures {what} needs the broker: --transport URL, MERSAL_TRANSPORT, or "
            "--app module:app"
        )
    transport = transport_from(target.transport)
    await transport.start()
    try:
        yield transport
    finally:
        await transport.stop()


async def failures_ingest(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures ingest`: the error queue into the store, until it is empty (or stopped)."""
    async with broker(target, "ingest") as transport:
        dead_letters = DeadLetters(transport, target.queue)
        stored = await store.ingest_all(dead_letters, batch=args.batch)
        print(f"stored {stored} failure(s) from {target.queue!r} of {mask(target.transport or '')}")
        while args.follow:
            done = await store.ingest(dead_letters, batch=args.batch)
            if done.stored:
                print(f"stored {done.stored} failure(s)")
    return 0


async def failures_groups(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures groups`: a line per group, the most recent first."""
    groups = await store.groups()
    if not groups:
        print(f"no stored failures of app {target.name!r}")
        return 0
    rows = [
        (g.key[:12], str(g.count), iso(g.first_seen), iso(g.last_seen), first_line(g.label))
        for g in groups
    ]
    for line in align([GROUP_COLUMNS, *rows]):
        print(line)
    return 0


async def failures_list(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures list`: a line per failure, newest first."""
    group = await full_group_key(store, args.group)
    failures = await store.page(group=group, search=args.search, limit=args.limit)
    if not failures:
        print(f"no stored failures of app {target.name!r}")
        return 0
    for line in align([LIST_COLUMNS, *(cells(failure) for failure in failures)]):
        print(line)
    return 0


def cells(failure: StoredFailure) -> tuple[str, ...]:
    """The failure's cells for LIST_COLUMNS."""
    return (
        str(failure.id),
        failure.message_id or "-",
        failure.type_name or "-",
        failure.error_type or "-",
        "-" if failure.attempts is None else str(failure.attempts),
        failure.source_queue or "-",
        iso(failure.failed_at),
        first_line(failure.error_message),
    )


async def failures_show(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures show ID`: every header, the body and the traceback."""
    failure = await store.get(args.id)
    if failure is None:
        raise ConfigurationError(f"no stored failure {args.id} of app {target.name!r}")
    print(f"group: {failure.group_label}")
    print("headers:")
    for name, value in sorted((failure.headers or {}).items()):
        print(f"  {name}: {value}")
    print(f"body ({len(failure.body or b'')} bytes):")
    print(body_text(failure.body or b""))
    return 0


async def failures_retry(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures retry`: back to their source queues; sent now when the broker is known."""
    group = await chosen_group(store, args, "retry")
    retried = await (store.retry_group(group) if group else store.retry(args.ids))
    print(f"{retried.sent} failure(s) queued in the outbox of app {target.name!r}")
    if retried.without_queue:
        listed = ", ".join(map(str, retried.without_queue))
        print(f"mersal: no source queue recorded, kept: {listed}", file=sys.stderr)
    if retried.sent and target.transport:
        async with broker(target, "retry") as transport:
            outbox = SqlOutboxStore(store.engine, store.tables.outbox, target.name)
            sent = await Relay(outbox, transport).flush()
        print(f"sent {sent} outbox row(s)")
    elif retried.sent:
        print("the app's outbox relay sends them")
    return 1 if retried.without_queue else 0


async def failures_delete(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures delete`: remove failures for good."""
    group = await chosen_group(store, args, "delete")
    deleted = await (store.delete_group(group) if group else store.delete(args.ids))
    print(f"deleted {deleted} failure(s)")
    return 0


async def chosen_group(store: DeadLetterStore, args: argparse.Namespace, what: str) -> str | None:
    """The group's full key when --group is given; a ConfigurationError unless ids xor group."""
    if bool(args.ids) == bool(args.group):
        raise ConfigurationError(f"mersal failures {what} needs failure ids or --group (not both)")
    return await full_group_key(store, args.group)


async def full_group_key(store: DeadLetterStore, prefix: str | None) -> str | None:
    """The group whose key starts with `prefix` (as `groups` prints it); None for None."""
    if prefix is None:
        return None
    keys = [group.key for group in await store.groups(limit=10_000) if group.key.startswith(prefix)]
    if len(keys) != 1:
        found = "no group" if not keys else f"{len(keys)} groups"
        raise ConfigurationError(
            f"{found} with a key starting {prefix!r}: see `mersal failures groups`"
        )
    return keys[0]
