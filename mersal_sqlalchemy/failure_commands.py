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
from pathlib import Path
from typing import Any

from sqlalchemy import URL
from sqlalchemy.exc import SQLAlchemyError

from mersal.app import App
from mersal.cli import align, load_app, positive_int
from mersal.dead_letters import DeadLetter, DeadLetters, details, printable
from mersal.errors import ConfigurationError, MersalError
from mersal.messages import Envelope
from mersal.outbox import Relay
from mersal.plugins import transport_from
from mersal.text import first_line, iso
from mersal.transport import Transport
from mersal.urls import mask
from mersal_sqlalchemy.dead_letters import INGEST_BATCH, PAGE, DeadLetterStore, StoredFailure
from mersal_sqlalchemy.engines import database_url, make_engine, reason
from mersal_sqlalchemy.outbox import SqlOutboxStore
from mersal_sqlalchemy.schema import read_schema, upgrade_command
from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, make_tables

FOLLOW_PAUSE = 1.0
MAX_FOLLOW_PAUSE = 30.0
"""Seconds `ingest --follow` waits before trying a database that failed again (doubling)."""

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
    groups.add_argument("--limit", type=positive_int, default=GROUPS, metavar="N")
    groups.set_defaults(handler=store_command(failures_groups))
    listing = actions.add_parser("list", parents=[common], help="stored failures, newest first")
    listing.add_argument("--group", default=None, help="only this group (a key from `groups`)")
    listing.add_argument("--search", default=None, help="text in the id, type or error")
    listing.add_argument("--limit", type=positive_int, default=PAGE, metavar="N")
    listing.set_defaults(handler=store_command(failures_list))
    show = actions.add_parser("show", parents=[common], help="a failure's headers, body, traceback")
    show.add_argument("id", type=row_id, help="the failure's id (from `list`)")
    show.set_defaults(handler=store_command(failures_show))
    retry = actions.add_parser(
        "retry", parents=[common], help="send failures back to their queues (through the outbox)"
    )
    retry.add_argument("ids", nargs="*", type=row_id, metavar="ID")
    retry.add_argument("--group", default=None, help="every failure of this group")
    retry.set_defaults(handler=store_command(failures_retry))
    delete = actions.add_parser("delete", parents=[common], help="remove failures for good")
    delete.add_argument("ids", nargs="*", type=row_id, metavar="ID")
    delete.add_argument("--group", default=None, help="every failure of this group")
    delete.set_defaults(handler=store_command(failures_delete))


GROUPS = 200
"""The groups `mersal failures groups` lists, by default."""

MAX_ID = 2**63 - 1


def row_id(text: str) -> int:
    """A failure's id as the command line gives it: a whole number the id column can hold."""
    if not text.isdigit() or not 0 < int(text) <= MAX_ID:
        raise argparse.ArgumentTypeError(f"{text!r} is not a failure's id (a positive number)")
    return int(text)


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
    """Run `action` on the target's store, disposing of the engine afterwards.

    The tables are checked first (`mersal db upgrade` named if they are missing or behind); a
    database that cannot be reached is a MersalError, its password masked.
    """
    url = database_url(target.database)
    tables = make_tables(args.outbox_table, args.inbox_table)
    if url.get_backend_name() == "sqlite" and not await asyncio.to_thread(_sqlite_exists, url):
        raise ConfigurationError(
            f"there is no SQLite database at {mask(target.database)}: check the URL, or create "
            f"it with `{upgrade_command(target.database, tables)}`"
        )
    engine = make_engine(url)
    try:
        try:
            async with engine.connect() as connection:
                schema = await connection.run_sync(read_schema, tables)
            problem = schema.explain(target.database, tables)
            if problem is not None:
                raise ConfigurationError(problem)
            return await action(DeadLetterStore(engine, tables, target.name), target, args)
        except (SQLAlchemyError, OSError) as error:
            raise MersalError(
                f"cannot use the database {mask(target.database)}: {reason(error, engine.url)}"
            ) from None
    finally:
        await engine.dispose()


def _sqlite_exists(url: URL) -> bool:
    database = url.database
    return not database or database == ":memory:" or Path(database).is_file()


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
        pause = FOLLOW_PAUSE
        while args.follow:
            try:
                done = await store.ingest(dead_letters, batch=args.batch)
            except (SQLAlchemyError, OSError) as error:
                # nothing was acked: the messages wait in the error queue for the next try
                why = reason(error, store.engine.url)
                print(f"mersal: cannot store, again in {pause:g}s: {why}", file=sys.stderr)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_FOLLOW_PAUSE)
                continue
            pause = FOLLOW_PAUSE
            if done.stored:
                print(f"stored {done.stored} failure(s)", flush=True)
            if not done.taken:
                await store.forget()
    return 0


async def failures_groups(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures groups`: a line per group, the most recent first."""
    groups = await store.groups(limit=args.limit)
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
    print(f"group: {printable(failure.group_label)}")
    print(details(DeadLetter(Envelope(failure.headers or {}, failure.body or b""))))
    return 0


async def failures_retry(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures retry`: back to their source queues; sent now when the broker is known."""
    group = await chosen_group(store, args, "retry")
    missing = [] if group else await unknown_ids(store, args.ids)
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
    return 1 if retried.without_queue or missing else 0


async def failures_delete(store: DeadLetterStore, target: Target, args: argparse.Namespace) -> int:
    """`mersal failures delete`: remove failures for good."""
    group = await chosen_group(store, args, "delete")
    missing = [] if group else await unknown_ids(store, args.ids)
    deleted = await (store.delete_group(group) if group else store.delete(args.ids))
    print(f"deleted {deleted} failure(s)")
    return 1 if missing else 0


async def unknown_ids(store: DeadLetterStore, ids: list[int]) -> list[int]:
    """The ids of no stored failure, each named on stderr."""
    missing = sorted(set(ids) - await store.existing(ids))
    if missing:
        listed = ", ".join(map(str, missing))
        print(f"mersal: no stored failure {listed} of app {store.app!r}", file=sys.stderr)
    return missing


async def chosen_group(store: DeadLetterStore, args: argparse.Namespace, what: str) -> str | None:
    """The group's full key when --group is given; a ConfigurationError unless ids xor group."""
    if args.group == "":
        raise ConfigurationError("--group needs a group's key: see `mersal failures groups`")
    if bool(args.ids) == bool(args.group):
        raise ConfigurationError(f"mersal failures {what} needs failure ids or --group (not both)")
    return await full_group_key(store, args.group)


async def full_group_key(store: DeadLetterStore, prefix: str | None) -> str | None:
    """The group whose key starts with `prefix` (as `groups` prints it); None for None."""
    if prefix is None:
        return None
    keys = await store.group_keys(prefix)
    if len(keys) != 1:
        found = "no group" if not keys else f"{len(keys)} groups"
        raise ConfigurationError(
            f"{found} with a key starting {prefix!r}: see `mersal failures groups`"
        )
    return keys[0]
