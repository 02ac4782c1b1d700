"""What `mersal db` does: our Alembic migrations on one pair of tables, knowing what Alembic cannot.

The pair is an outbox and an inbox; the saga table follows the inbox (`saga_table_name`), so it
is migrated, recorded and shared with it.

Alembic sees only the pair's own version table. Before it runs, these functions look at the
database as a whole: tables your own migrations made (recorded at the head, rather than created
again, unless your Alembic project's `alembic_version` is there), a revision in the version
table of earlier releases (taken over), our branch in your Alembic project's `alembic_version`
(left to that project), other pairs sharing a table (left by a downgrade). After an upgrade
they check that the tables are really there, so that no command reports success and creates
nothing.

Every function here blocks and runs an event loop of its own: from async code, call it through
`asyncio.to_thread`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from mersal.errors import ConfigurationError, MersalError
from mersal.urls import mask
from mersal_sqlalchemy.engines import database_url, make_engine, reason
from mersal_sqlalchemy.migrations import SCRIPTS
from mersal_sqlalchemy.schema import (
    Record,
    Schema,
    count_rows,
    db_command,
    foreign_columns,
    read_schema,
    recorded_elsewhere,
)
from mersal_sqlalchemy.tables import (
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    HEAD_REVISION,
    REVISIONS,
    Tables,
    make_tables,
    revision_rank,
)

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Connection

T = TypeVar("T")
NO_CREATE_RIGHTS = "permission denied for schema"
"""PostgreSQL's words when the user may not create tables."""
CREATE_RIGHTS_HINT = (
    "grant CREATE on the schema to this user, or have a DBA apply `mersal db upgrade --sql`"
)
"""What to do when the user may not create tables."""


def alembic_config(
    database: str | None,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    *,
    dialect: str | None = None,
) -> Config:
    """An Alembic configuration for our migrations, as `alembic -x ...` would make it."""
    from alembic.config import Config

    if not (SCRIPTS / "env.py").is_file():
        raise ConfigurationError(
            f"the migrations directory {SCRIPTS} is missing: reinstall mersal-bus[sqlalchemy] "
            "(it ships them), or run alembic in your own project (see docs/outbox.md)"
        )
    arguments = [f"outbox_table={outbox_table}", f"inbox_table={inbox_table}"]
    if database:
        arguments.append(f"database={database}")
    if dialect:
        arguments.append(f"dialect={dialect}")
    # Alembic binds sys.stdout when it is imported: give it the one in use now.
    config = Config(
        cmd_opts=argparse.Namespace(x=arguments), stdout=sys.stdout, output_buffer=sys.stdout
    )
    config.set_main_option("script_location", str(SCRIPTS).replace("%", "%%"))
    return config


def upgrade(
    database: str | None,
    *,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    revision: str = "head",
    sql: bool = False,
    dialect: str | None = None,
) -> str:
    """Apply the migrations up to `revision`; returns what was done, in words.

    With `sql`, print the SQL instead, connecting to nothing (the dialect from `dialect` or
    from the URL). Tables that exist without a revision of ours (your own migration made them)
    are recorded at the head rather than created again.
    """
    tables = make_tables(outbox_table, inbox_table)
    config = alembic_config(database, outbox_table, inbox_table, dialect=dialect)
    if sql:
        _alembic("upgrade", database, lambda command: command.upgrade(config, revision, sql=True))
        return ""
    database = _online(database)
    before = look(database, tables, create=True)
    if before.record is not None and before.record.unknown:
        return _newer(database, tables, before) + ": nothing to upgrade"
    took_over = _take_over(database, tables, config, before)
    _alembic("upgrade", database, lambda command: command.upgrade(config, revision))
    after = look(database, tables)
    if after.record is not None and HEAD_REVISION in after.record.revisions:
        problem = after.explain(database, tables)
        if problem is not None:
            raise MersalError(f"the upgrade ran, but {problem}")
    return took_over + _at(database, after)


def downgrade(
    database: str | None,
    revision: str,
    *,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    sql: bool = False,
    dialect: str | None = None,
    force: bool = False,
) -> str:
    """Undo the migrations down to `revision` (`base` drops the tables); returns what was done.

    A table another pair's version table records is left (and said so); an outbox, saga or
    dead-letter table holding rows is not dropped unless `force`. With `sql` it cannot look,
    and prints every drop.
    """
    tables = make_tables(outbox_table, inbox_table)
    config = alembic_config(database, outbox_table, inbox_table, dialect=dialect)
    if sql:
        _alembic(
            "downgrade", database, lambda command: command.downgrade(config, revision, sql=True)
        )
        return ""
    database = _online(database)
    schema = look(database, tables)
    record = schema.record
    if record is None or record.newest is None:
        owned = "" if schema.reached is None else " (tables your own migrations made are yours)"
        raise MersalError(
            f"no revision of ours is recorded for {_pair(tables)} in {mask(database)}: there "
            f"is nothing to downgrade{owned}"
        )
    _refuse_shared(record, database, tables, "downgrade")
    if record.unknown:
        raise MersalError(
            f"the tables in {mask(database)} are at migration {', '.join(record.unknown)}, "
            f"which this version of mersal_sqlalchemy does not know: downgrade them with the "
            f"release that migrated them (`{db_command(f'downgrade {revision}', database, tables)}`"
            " there)"
        )
    dropped = _dropped(tables, record.newest, _target(config, revision, record.newest))
    left = _before_drop(database, tables, dropped, force) if dropped else ""
    took_over = _take_over(database, tables, config, schema)
    _alembic("downgrade", database, lambda command: command.downgrade(config, revision))
    return took_over + left + _at(database, look(database, tables))


def stamp(
    database: str | None,
    revision: str = "head",
    *,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    sql: bool = False,
    dialect: str | None = None,
) -> str:
    """Record the tables as at `revision` without changing them; returns what was done.

    Refused when they could not be at it: a table missing (anything but `base`), or a column
    missing at the head.
    """
    tables = make_tables(outbox_table, inbox_table)
    config = alembic_config(database, outbox_table, inbox_table, dialect=dialect)
    if sql:
        _alembic("stamp", database, lambda command: command.stamp(config, revision, sql=True))
        return ""
    database = _online(database)
    _check_stamp(look(database, tables), database, tables, _resolve(config, revision))
    _alembic("stamp", database, lambda command: command.stamp(config, revision))
    return _at(database, look(database, tables))


def current(
    database: str | None, *, outbox_table: str = DEFAULT_OUTBOX, inbox_table: str = DEFAULT_INBOX
) -> str:
    """The revision recorded for the tables and where, in words."""
    database = _online(database)
    tables = make_tables(outbox_table, inbox_table)
    schema = look(database, tables)
    record = schema.record
    if record is not None and record.revisions:
        where = record.table + (" (your Alembic project's)" if record.shared else "")
        return f"{', '.join(_named(v) for v in record.revisions)}, recorded in {where}" + (
            _compatibility(record)
        )
    if schema.reached is not None and schema.alembic_project:
        return (
            f"no revision recorded; {_pair(tables)} exist (made by your Alembic project, whose "
            "alembic_version records no revision of ours by name: your own migration, or our "
            "branch merged)"
        )
    if schema.reached is not None:
        return f"no revision recorded; {_pair(tables)} exist (made by your own migrations?)"
    return f"no revision recorded; the table(s) {', '.join(schema.missing_tables)} do not exist"


def tables_problem(
    database: str | None, *, outbox_table: str = DEFAULT_OUTBOX, inbox_table: str = DEFAULT_INBOX
) -> str | None:
    """What keeps an app from using the tables, with the fix; None when it can use them."""
    return verdict(database, outbox_table=outbox_table, inbox_table=inbox_table)[0]


def verdict(
    database: str | None, *, outbox_table: str = DEFAULT_OUTBOX, inbox_table: str = DEFAULT_INBOX
) -> tuple[str | None, str]:
    """What keeps an app from using the tables (None: nothing), and how they are, in words."""
    database = _online(database)
    tables = make_tables(outbox_table, inbox_table)
    schema = look(database, tables)
    problem = schema.explain(database, tables)
    if schema.record is not None and schema.record.newer:
        return problem, schema.newer(database)
    return problem, f"the outbox, inbox and saga tables in {mask(database)} are up to date"


def history() -> None:
    """Print our revisions, newest first (no database needed)."""
    config = alembic_config(None)
    _alembic("history", None, lambda command: command.history(config))


def look(database: str, tables: Tables, *, create: bool = False) -> Schema:
    """What the database holds of the tables (a missing SQLite file is refused unless `create`)."""
    url = database_url(database)
    if url.get_backend_name() == "sqlite" and not create and not Path(url.database or "").is_file():
        raise ConfigurationError(f"there is no SQLite database at {mask(database)}")

    return _run(database, lambda connection: read_schema(connection, tables))


def _run(database: str, call: Callable[[Connection], T]) -> T:
    """`call` on a connection to the database, in a transaction of its own."""

    async def run() -> T:
        engine = make_engine(database_url(database))
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(call)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(run())
    except (SQLAlchemyError, OSError) as error:
        raise MersalError(
            f"cannot look at the database {mask(database)}: {reason(error, database)}"
        ) from None


def _take_over(database: str, tables: Tables, config: Config, schema: Schema) -> str:
    """Record the tables' revision in their own version table when it is found elsewhere.

    Returns what was recorded, in words ('' for nothing). Refused: tables whose revision is in
    your Alembic project's `alembic_version`, tables without one beside that table (its history
    may record them), and tables of your own that lack a column. Tables of your own are
    recorded at the newest revision whose tables all exist: the upgrade creates the others.
    """
    record = schema.record
    if schema.reached is None:
        return ""  # the first revision creates what is missing
    if record is not None and record.table == tables.version.name and record.revisions:
        return ""  # Alembic goes on from there
    if record is not None and record.revisions:
        _refuse_shared(record, database, tables, "upgrade")
        revisions = record.revisions
        found = f"found {', '.join(revisions)} recorded in {record.table}"
    elif schema.missing_columns:
        name, columns = next(iter(schema.missing_columns.items()))
        stamp_command = db_command("stamp REVISION", database, tables)
        raise MersalError(
            f"{_pair(tables)} exist in {mask(database)} without a revision of ours, and {name} "
            f"has no column(s) {', '.join(columns)}: record the revision they are at with "
            f"`{stamp_command}`, then run this again"
        )
    elif schema.alembic_project:
        raise MersalError(_project_tables(database, tables, schema.reached))
    else:
        revisions = [schema.reached]
        found = f"found {_pair(tables)} without a revision of ours (made by your own migration?)"
    _alembic("stamp", database, lambda command: command.stamp(config, revisions))
    return f"{found}: recorded them at {', '.join(revisions)} in {tables.version.name}\n"


def _newer(database: str, tables: Tables, schema: Schema) -> str:
    """That a newer release migrated the tables, in words; a MersalError if this one cannot run."""
    problem = schema.explain(database, tables)
    if problem is not None:
        raise MersalError(problem)
    return schema.newer(database)


def _compatibility(record: Record) -> str:
    """What this release makes of recorded revisions it does not know, in words ('' for none)."""
    if not record.unknown:
        return ""
    if record.newer:
        runs = ", ".join(record.compatible_with[v] for v in record.unknown)
        return f" (newer than this release's {HEAD_REVISION}; code of {runs} or later runs on it)"
    newer = f" (newer than this release's {HEAD_REVISION}"
    if record.malformed:
        revision, value = next(iter(record.malformed.items()))
        return (
            f"{newer}; the compatible_with recorded for {revision} in {record.schema}, "
            f"{value!r}, is not a Mersal revision)"
        )
    if record.needs:
        return f"{newer}; it needs code of {record.needs} or later)"
    return f"{newer}, or unknown to it; no compatibility recorded)"


def _project_tables(database: str, tables: Tables, reached: str) -> str:
    """Why tables beside your Alembic project's `alembic_version` are not taken over silently."""
    if reached == HEAD_REVISION:
        hand_over = f"run `{db_command('stamp head', database, tables)}` once"
    else:  # the upgrade then creates what the tables lack
        stamp = db_command(f"stamp {reached}", database, tables)
        hand_over = f"run `{stamp}` once, then `{db_command('upgrade', database, tables)}`"
    return (
        f"{_pair(tables)} exist in {mask(database)} without a revision of ours, beside your "
        "Alembic project's alembic_version: if your own Alembic project manages these tables, "
        "keep using `alembic upgrade head` there; if you want `mersal db` to manage them, "
        f"{hand_over}"
    )


def _target(config: Config, revision: str, current: str) -> str | None:
    """The revision of ours a downgrade from `current` to `revision` reaches (None for base)."""
    from alembic.script import Script, ScriptDirectory
    from alembic.util import CommandError

    steps = re.fullmatch(r"-(\d+)", revision)
    if steps:  # back from the recorded revision
        rank = revision_rank(current) - int(steps.group(1))
        return REVISIONS[rank] if 0 <= rank < len(REVISIONS) else None
    try:
        resolved = ScriptDirectory.from_config(config).get_revisions(revision)
    except CommandError:
        return None  # another relative one ("head-1"): as if to base; Alembic judges it next
    found = [script.revision for script in resolved if isinstance(script, Script)]
    return max(found, key=revision_rank, default=None)


def _dropped(tables: Tables, current: str, target: str | None) -> list[str]:
    """The tables that the revisions after `target`, up to `current`, create: those undone."""
    low = revision_rank(target) if target is not None else -1
    high = revision_rank(current)
    return [name for name, made in tables.made_by.items() if low < revision_rank(made) <= high]


def _before_drop(database: str, tables: Tables, dropped: list[str], force: bool) -> str:
    """What the drops leave, in words; a MersalError for rows they would lose (unless `force`)."""
    left, rows = _run(database, lambda connection: _shared_and_rows(connection, tables, dropped))
    for name, count in rows.items():
        if count and not force:
            raise MersalError(
                f"{name} in {mask(database)} holds {count} row(s), {_held_in(tables, name)}: "
                "the downgrade would drop them; pass --force to drop them anyway"
            )
    return "".join(f"left {name}: {why}\n" for name, why in left.items())


def _held_in(tables: Tables, name: str) -> str:
    """What the rows of the outbox, the saga or the dead-letter table are, in words."""
    if name == tables.outbox.name:
        return "messages not sent yet (or parked)"
    if name == tables.dead_letters.name:
        return "failed messages not retried or deleted yet"
    return "the state of sagas not finished yet"


def _shared_and_rows(
    connection: Connection, tables: Tables, dropped: list[str]
) -> tuple[dict[str, str], dict[str, int]]:
    """Of the tables to drop, those left (and why), and the rows the others would lose.

    Left: those other pairs record, and a saga or schema table that is not ours (other columns).
    """
    shared = recorded_elsewhere(connection, tables.outbox.name, tables.inbox.name)
    left = {
        name: f"{version} records it for another pair of tables"
        for name, version in shared.items()
        if name in dropped
    }
    ours = ((tables.sagas, "saga"), (tables.schema, "schema"), (tables.dead_letters, "dead-letter"))
    for table, what in ours:
        columns = foreign_columns(connection, table)
        if table.name in dropped and table.name not in left and columns is not None:
            left[table.name] = (
                f"it is not Mersal's {what} table (it has the column(s) {', '.join(columns)})"
            )
    present = set(inspect(connection).get_table_names())
    guarded = [tables.outbox.name, tables.sagas.name, tables.dead_letters.name]
    return left, {
        name: count_rows(connection, name, unresolved=name == tables.dead_letters.name)
        for name in guarded
        if name in dropped and name in present and name not in left
    }


def _refuse_shared(record: Record, database: str, tables: Tables, action: str) -> None:
    """A MersalError if your own Alembic project records the tables' revision."""
    if record.shared:
        stamp = db_command(f"stamp {record.revisions[0]}", database, tables)
        raise MersalError(
            f"the tables in {mask(database)} are migrated by your own Alembic project "
            f"({', '.join(record.revisions)} in alembic_version): {action} them there "
            f"(`alembic {action} ...`), or take them over with `{stamp}` first"
        )


def _check_stamp(schema: Schema, database: str, tables: Tables, revisions: tuple[str, ...]) -> None:
    target = max(revisions, key=revision_rank, default=None)
    missing = schema.missing_at(target)
    if missing and schema.reached is not None:
        stamp = db_command(f"stamp {schema.reached}", database, tables)
        raise MersalError(
            f"the table(s) {', '.join(missing)} do not exist in {mask(database)}, so the tables "
            f"are not at {target}: record the revision they are at with `{stamp}`, then run "
            f"`{db_command('upgrade', database, tables)}`"
        )
    if missing:
        raise MersalError(
            f"the table(s) {', '.join(missing)} do not exist in {mask(database)}: "
            f"create them with `{db_command('upgrade', database, tables)}` rather than record "
            "a revision for them"
        )
    if HEAD_REVISION in revisions and schema.missing_columns:
        name, columns = next(iter(schema.missing_columns.items()))
        raise MersalError(
            f"table {name} has no column(s) {', '.join(columns)}, so it is not at "
            f"{HEAD_REVISION}: record the revision it is at"
        )


def _resolve(config: Config, revision: str) -> tuple[str, ...]:
    """The revision ids `revision` names (none for `base`); a MersalError for no such one."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        resolved = ScriptDirectory.from_config(config).get_revisions(revision)
    except CommandError as error:
        raise MersalError(f"no revision {revision!r} of ours: {error}") from None
    return tuple(script.revision for script in resolved if script is not None)


def _alembic(action: str, database: str | None, call: Callable[[Any], Any]) -> Any:
    """Run `call(alembic.command)`, its failures turned into MersalErrors."""
    from alembic import command
    from alembic.util import CommandError

    where = f" the tables in {mask(database)}" if database else ""
    try:
        return call(command)
    except CommandError as error:
        raise MersalError(f"{action}{where} failed: {error}") from None
    except (SQLAlchemyError, OSError) as error:
        raise MersalError(f"{action}{where} failed: {_hinted(reason(error, database))}") from None


def _hinted(text: str) -> str:
    """The driver's words, with what to do when the user may not create tables."""
    return f"{text}; {CREATE_RIGHTS_HINT}" if NO_CREATE_RIGHTS in text else text


def _online(database: str | None) -> str:
    if not database:
        raise ConfigurationError("no database: pass --database URL or set MERSAL_DATABASE")
    return database


def _at(database: str, schema: Schema) -> str:
    record = schema.record
    revisions = record.revisions if record is not None else []
    at = ", ".join(_named(v) for v in revisions) if revisions else "base (no revision recorded)"
    return f"the outbox, inbox and saga tables in {mask(database)} are at {at}"


def _named(revision: str) -> str:
    return f"{revision} (head)" if revision == HEAD_REVISION else revision


def _pair(tables: Tables) -> str:
    return f"{tables.outbox.name} and {tables.inbox.name}"
