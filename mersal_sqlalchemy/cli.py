"""`mersal db ...` (migrating.py) and `mersal outbox list|retry|purge` (repairs.py), as commands."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, Table, inspect
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal.cli import ProgressLine, align, positive_int
from mersal.errors import ConfigurationError, MersalError
from mersal.text import first_line, iso
from mersal.urls import mask
from mersal_sqlalchemy import migrating
from mersal_sqlalchemy.engines import DIALECTS, database_url, make_engine, reason
from mersal_sqlalchemy.migrating import alembic_config, upgrade
from mersal_sqlalchemy.migrations import SCRIPTS
from mersal_sqlalchemy.repairs import (
    LIST_LIMIT,
    ListedRow,
    id_list,
    list_rows,
    purge_rows,
    retry_rows,
)
from mersal_sqlalchemy.schema import upgrade_command
from mersal_sqlalchemy.tables import (
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    DEFAULT_SAGAS,
    make_tables,
    outbox_table,
)

__all__ = ["MIGRATIONS", "add_db_commands", "add_outbox_commands", "alembic_config", "upgrade"]

MIGRATIONS = SCRIPTS
"""Our Alembic script directory (kept under this name for earlier callers)."""


def add_db_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `db upgrade|downgrade|stamp|current|check|history` to the `mersal` command."""
    tables, offline = _tables_options(), _offline_options()
    db = commands.add_parser("db", help="manage the outbox, inbox and saga tables")
    actions = db.add_subparsers(dest="db_command", required=True)
    upgrade_parser = actions.add_parser(
        "upgrade",
        parents=[tables, offline],
        help="create or upgrade the tables (tables without a revision are recorded at the head)",
    )
    upgrade_parser.add_argument("--revision", default="head", help="the revision to reach (head)")
    upgrade_parser.set_defaults(handler=run_upgrade)
    downgrade_parser = actions.add_parser(
        "downgrade", parents=[tables, offline], help="undo migrations (base: drop the tables)"
    )
    downgrade_parser.add_argument(
        "revision", help="the revision to go back to; with --sql, FROM:TO (head:base)"
    )
    downgrade_parser.add_argument(
        "--force",
        action="store_true",
        help="drop an outbox, saga or dead-letter table even if it holds rows",
    )
    downgrade_parser.set_defaults(handler=run_downgrade)
    stamp_parser = actions.add_parser(
        "stamp", parents=[tables, offline], help="record the tables' revision, changing nothing"
    )
    stamp_parser.add_argument(
        "revision", nargs="?", default="head", help="the revision they are at (head)"
    )
    stamp_parser.set_defaults(handler=run_stamp)
    current_parser = actions.add_parser(
        "current", parents=[tables], help="the revision recorded for the tables, and where"
    )
    current_parser.set_defaults(handler=run_current)
    check_parser = actions.add_parser(
        "check", parents=[tables], help="exit 1 unless an app can use the tables as they are"
    )
    check_parser.set_defaults(handler=run_check)
    history_parser = actions.add_parser("history", help="our revisions, newest first")
    history_parser.set_defaults(handler=run_history)


def _tables_options() -> argparse.ArgumentParser:
    """--database, --outbox-table and --inbox-table, for every `mersal db` command."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--database", default=None, metavar="URL", help="the database URL ($MERSAL_DATABASE)"
    )
    options.add_argument(
        "--outbox-table",
        default=DEFAULT_OUTBOX,
        metavar="NAME",
        help=f"the outbox table ({DEFAULT_OUTBOX})",
    )
    options.add_argument(
        "--inbox-table",
        default=DEFAULT_INBOX,
        metavar="NAME",
        help=(
            f"the inbox table ({DEFAULT_INBOX}), which names the saga table ({DEFAULT_SAGAS} "
            "beside the default inbox, else <inbox>_sagas)"
        ),
    )
    return options


def _offline_options() -> argparse.ArgumentParser:
    """--sql and --dialect, for the commands that can print their SQL."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--sql", action="store_true", help="print the SQL instead of running it (no connection)"
    )
    options.add_argument(
        "--dialect",
        choices=DIALECTS,
        default=None,
        help="the SQL dialect for --sql (default: the --database URL's)",
    )
    return options


def run_upgrade(args: argparse.Namespace) -> int:
    """`mersal db upgrade`: create or upgrade the tables, or print the SQL."""
    _show_progress()
    report = migrating.upgrade(
        _database(args),
        revision=args.revision,
        outbox_table=args.outbox_table,
        inbox_table=args.inbox_table,
        sql=args.sql,
        dialect=args.dialect,
    )
    return _done(report)


def run_downgrade(args: argparse.Namespace) -> int:
    """`mersal db downgrade REVISION`: undo migrations, or print the SQL."""
    _show_progress()
    report = migrating.downgrade(
        _database(args),
        args.revision,
        outbox_table=args.outbox_table,
        inbox_table=args.inbox_table,
        sql=args.sql,
        dialect=args.dialect,
        force=args.force,
    )
    return _done(report)


def run_stamp(args: argparse.Namespace) -> int:
    """`mersal db stamp [REVISION]`: record the tables' revision."""
    _show_progress()
    report = migrating.stamp(
        _database(args),
        args.revision,
        outbox_table=args.outbox_table,
        inbox_table=args.inbox_table,
        sql=args.sql,
        dialect=args.dialect,
    )
    return _done(report)


def run_current(args: argparse.Namespace) -> int:
    """`mersal db current`: print the revision recorded for the tables, and where."""
    database = _database(args)
    print(migrating.current(database, outbox_table=args.outbox_table, inbox_table=args.inbox_table))
    return 0


def run_check(args: argparse.Namespace) -> int:
    """`mersal db check`: 0 when an app can use the tables, else 1 and what to run."""
    database = _database(args)
    problem, report = migrating.verdict(
        database, outbox_table=args.outbox_table, inbox_table=args.inbox_table
    )
    if problem is not None:
        print(f"mersal: {problem}", file=sys.stderr)
        return 1
    print(report)
    return 0


def run_history(args: argparse.Namespace) -> int:
    """`mersal db history`: print our revisions."""
    migrating.history()
    return 0


def _database(args: argparse.Namespace) -> str | None:
    """The database URL, required unless --sql has a --dialect."""
    database: str | None = args.database or os.environ.get("MERSAL_DATABASE") or None
    offline = getattr(args, "sql", False)
    if database is None and not (offline and args.dialect):
        needs = "--database URL or MERSAL_DATABASE"
        if offline:
            needs = "--dialect postgresql|sqlite, or a database URL (only its dialect is used)"
        raise ConfigurationError(f"mersal db {args.db_command} needs {needs}")
    return database


def _show_progress() -> None:
    """Let Alembic's "Running upgrade ..." lines through to stderr."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)


def _done(report: str) -> int:
    """Print what a migrating command did (nothing after --sql, which printed the SQL)."""
    if report:
        print(report)
    return 0


# mersal outbox list|retry|purge

LIST_COLUMNS = ("ID", "APP", "KIND", "ADDRESS", "TYPE", "MESSAGE-ID", "ATTEMPTS", "CREATED")
"""The columns of `mersal outbox list`."""
PARKED_COLUMNS = ("PARKED", "REASON")
"""The columns `mersal outbox list` adds when a listed row is parked."""
REASON_WIDTH = 200
"""The characters of a parked row's reason shown."""


def add_outbox_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `outbox list|retry|purge` to the `mersal` command's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database",
        default=None,
        metavar="URL",
        help="the database URL (default: $MERSAL_DATABASE)",
    )
    common.add_argument(
        "--outbox-table",
        default=DEFAULT_OUTBOX,
        metavar="NAME",
        help=f"the outbox table ({DEFAULT_OUTBOX})",
    )
    outbox = commands.add_parser("outbox", help="look at, send again or delete outbox rows")
    actions = outbox.add_subparsers(dest="outbox_command", required=True)
    listing = actions.add_parser(
        "list", parents=[common], help="one line per row, oldest first (parked: with the reason)"
    )
    listing.add_argument("--parked", action="store_true", help="only the parked rows")
    listing.add_argument("--app", default=None, metavar="NAME", help="only the rows this app sent")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=LIST_LIMIT,
        metavar="N",
        help=f"at most N rows ({LIST_LIMIT})",
    )
    listing.set_defaults(handler=outbox_command(outbox_list))
    retry = actions.add_parser(
        "retry", parents=[common], help="un-park rows, so that their app's relay sends them again"
    )
    retry.add_argument("ids", nargs="*", type=int, metavar="ID", help="the rows to un-park")
    retry.add_argument("--all", action="store_true", help="every parked row")
    retry.add_argument("--app", default=None, metavar="NAME", help="only the rows this app sent")
    retry.set_defaults(handler=outbox_command(outbox_retry))
    purge = actions.add_parser(
        "purge", parents=[common], help="delete parked rows (the messages are never sent)"
    )
    purge.add_argument("ids", nargs="+", type=int, metavar="ID", help="the parked rows to delete")
    purge.set_defaults(handler=outbox_command(outbox_purge))


OutboxAction = Callable[[AsyncEngine, Table, argparse.Namespace], Awaitable[int]]
"""What a `mersal outbox` command does with the outbox table: its exit status."""


def outbox_command(action: OutboxAction) -> Callable[[argparse.Namespace], int]:
    """A command handler running `action` on the outbox table through a short-lived engine."""

    def run(args: argparse.Namespace) -> int:
        database = args.database or os.environ.get("MERSAL_DATABASE")
        if not database:
            raise ConfigurationError(
                f"mersal outbox {args.outbox_command} needs --database URL or MERSAL_DATABASE"
            )
        url = database_url(database)
        if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
            raise ConfigurationError(f"there is no SQLite database at {mask(database)}")
        table = outbox_table(args.outbox_table, MetaData())
        return asyncio.run(with_outbox(url, database, table, args, action))

    return run


async def with_outbox(
    url: URL, database: str, table: Table, args: argparse.Namespace, action: OutboxAction
) -> int:
    """Run `action` on `table` at `url`, turning database errors into masked MersalErrors."""
    engine = make_engine(url)
    try:
        async with engine.connect() as connection:
            exists = await connection.run_sync(lambda sync: inspect(sync).has_table(table.name))
        if not exists:
            upgrade = upgrade_command(database, make_tables(table.name))
            raise ConfigurationError(
                f"there is no table {table.name} in {mask(database)}: check --outbox-table, "
                f"or create it with `{upgrade}`"
            )
        return await action(engine, table, args)
    except (SQLAlchemyError, OSError) as error:
        raise MersalError(f"the outbox in {mask(database)}: {reason(error, url)}") from None
    finally:
        await engine.dispose()


async def outbox_list(engine: AsyncEngine, table: Table, args: argparse.Namespace) -> int:
    """`mersal outbox list`: a line per row, parked rows with when and why.

    Exits 1 when rows are parked (they need an operator), else 0.
    """
    rows, total, parked = await list_rows(
        engine, table, parked=args.parked, app=args.app, limit=args.limit
    )
    what = ("parked " if args.parked else "") + "outbox row(s)"
    of_app = f" of app {args.app!r}" if args.app is not None else ""
    if not rows:
        print(f"no {what}{of_app}")
        return 0
    parked_columns = any(row.parked for row in rows)
    header = (*LIST_COLUMNS, *PARKED_COLUMNS) if parked_columns else LIST_COLUMNS
    for line in align([header, *(row_cells(row, parked_columns) for row in rows)]):
        print(line)
    if total > len(rows):
        footer = f"the first {len(rows)} of {total} {what}{of_app} (--limit N for more)"
    else:
        footer = f"{total} {what}{of_app}"
    if not args.parked:
        footer += f", {parked} of them parked"
    print(footer)
    if parked:
        print(
            f"mersal: {parked} parked row(s) need an operator: fix the cause, then "
            "`mersal outbox retry ID...` (or `purge`)",
            file=sys.stderr,
        )
        return 1
    return 0


async def outbox_retry(engine: AsyncEngine, table: Table, args: argparse.Namespace) -> int:
    """`mersal outbox retry`: un-park rows; print how many."""
    if bool(args.ids) == bool(args.all):
        raise ConfigurationError("mersal outbox retry needs row ids or --all (not both)")
    ids = None if args.all else args.ids
    retried = await retry_rows(engine, table, ids, app=args.app)
    listed = f": {id_list(retried)}" if retried else ""
    print(f"un-parked {len(retried)} row(s){listed}; their apps' relays send them again")
    left = sorted(set(ids or ()) - set(retried))
    if left:
        of_app = f" of app {args.app!r}" if args.app is not None else ""
        print(
            f"mersal: not parked rows{of_app} (or not in the outbox): {id_list(left)}",
            file=sys.stderr,
        )
        return 1
    return 0


async def outbox_purge(engine: AsyncEngine, table: Table, args: argparse.Namespace) -> int:
    """`mersal outbox purge`: delete parked rows, refusing if any named row is not parked."""
    with ProgressLine("purged") as progress:
        purged = await purge_rows(engine, table, args.ids, progress)
    print(f"purged {len(purged)} parked row(s): {id_list(purged)}")
    return 0


def row_cells(row: ListedRow, parked_columns: bool) -> tuple[str, ...]:
    """The row's cells for LIST_COLUMNS, and PARKED_COLUMNS if `parked_columns`."""
    cells = (
        str(row.id),
        row.app,
        "publish" if row.publish else "send",
        row.address,
        row.type_name or "-",
        row.message_id or "-",
        str(row.attempts),
        iso(row.created_at),
    )
    if not parked_columns:
        return cells
    if not row.parked:
        return (*cells, "-", "-")
    return (*cells, iso(row.parked_at), first_line(row.parked_reason, REASON_WIDTH))
