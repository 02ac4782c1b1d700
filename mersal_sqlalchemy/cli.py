"""`mersal db upgrade`: apply the outbox and inbox migrations (Alembic) to a database."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mersal.errors import ConfigurationError, MersalError
from mersal.transport import mask
from mersal_sqlalchemy.database import database_url
from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, make_tables

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def add_db_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `db upgrade` to the `mersal` command's subcommands."""
    db = commands.add_parser("db", help="manage the outbox and inbox tables")
    actions = db.add_subparsers(dest="db_command", required=True)
    upgrade = actions.add_parser(
        "upgrade", help="create or upgrade the outbox and inbox tables (alembic upgrade head)"
    )
    upgrade.add_argument(
        "--database", default=None, help="the database URL (default: $MERSAL_DATABASE)"
    )
    upgrade.add_argument(
        "--outbox-table", default=DEFAULT_OUTBOX, help=f"the outbox table ({DEFAULT_OUTBOX})"
    )
    upgrade.add_argument(
        "--inbox-table", default=DEFAULT_INBOX, help=f"the inbox table ({DEFAULT_INBOX})"
    )
    upgrade.add_argument("--revision", default="head", help="the revision to reach (head)")
    upgrade.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    upgrade.set_defaults(handler=run_upgrade)


def run_upgrade(args: argparse.Namespace) -> int:
    """Carry out `mersal db upgrade` as parsed by `add_db_commands`."""
    database = args.database or os.environ.get("MERSAL_DATABASE")
    if not database:
        raise ConfigurationError("mersal db upgrade needs --database URL or MERSAL_DATABASE")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)
    upgrade(
        database,
        outbox_table=args.outbox_table,
        inbox_table=args.inbox_table,
        revision=args.revision,
        sql=args.sql,
    )
    if not args.sql:
        print(f"the outbox and inbox tables in {mask(database)} are at revision {args.revision}")
    return 0


def upgrade(
    database: str,
    *,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    revision: str = "head",
    sql: bool = False,
) -> None:
    """Apply the migrations to `database` up to `revision`.

    Blocking, and it runs an event loop of its own: from async code, call it through
    `asyncio.to_thread`.
    """
    from alembic import command
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    database_url(database)
    make_tables(outbox_table, inbox_table)
    config = alembic_config(database, outbox_table, inbox_table)
    try:
        command.upgrade(config, revision, sql=sql)
    except (CommandError, SQLAlchemyError, OSError) as error:
        raise MersalError(f"upgrading the tables in {mask(database)} failed: {error}") from None


def alembic_config(database: str, outbox_table: str, inbox_table: str) -> Config:
    """An Alembic configuration for our migrations, as `alembic -x ...` would make it."""
    from alembic.config import Config

    if not (MIGRATIONS / "env.py").is_file():
        raise ConfigurationError(
            f"the migrations directory {MIGRATIONS} is missing: reinstall mersal[sqlalchemy] "
            "(it ships them), or run alembic in your own project (see docs/outbox.md)"
        )
    options = argparse.Namespace(
        x=[f"database={database}", f"outbox_table={outbox_table}", f"inbox_table={inbox_table}"]
    )
    config = Config(cmd_opts=options)
    config.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    return config
