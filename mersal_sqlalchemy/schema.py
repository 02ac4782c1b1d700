"""The schema check at start: what the database holds of our tables, whether an app can use them.

`prepare_schema` reads it (`Schema`, with the `Record` of our revisions), creates what is
missing when asked, and refuses what this release cannot run on with the command that fixes it;
`recorded_elsewhere` and `foreign_columns` tell a downgrade what it must leave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sqlalchemy import Connection, Table, column, delete, func, insert, inspect, select, table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.urls import mask
from mersal_sqlalchemy.engines import CANNOT_CONNECT_NOW
from mersal_sqlalchemy.tables import (
    COMPATIBLE_WITH,
    DEAD_LETTERS_SUFFIX,
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    HEAD_REVISION,
    REVISIONS,
    SAGAS_SUFFIX,
    SCHEMA_REVISION,
    SCHEMA_SUFFIX,
    Tables,
    compatible,
    dead_letters_table_name,
    legacy_version_table_name,
    made_by,
    revision_rank,
    saga_table_name,
    schema_table_name,
    version_table_name,
)

log = logging.getLogger("mersal.sqlalchemy")

SHARED_VERSION_TABLE = "alembic_version"
"""Your own Alembic project's version table (where our branch may be recorded)."""
REVISION_PREFIX = "mersal_"
"""What every revision id of ours begins with."""


def db_command(action: str, database: str, tables: Tables) -> str:
    """The `mersal db <action>` command line for these tables (the password masked)."""
    command = f"mersal db {action} --database '{mask(database)}'"
    if tables.outbox.name != DEFAULT_OUTBOX:
        command += f" --outbox-table {tables.outbox.name}"
    if tables.inbox.name != DEFAULT_INBOX:
        command += f" --inbox-table {tables.inbox.name}"
    return command


def upgrade_command(database: str, tables: Tables) -> str:
    """The command that creates or upgrades the tables (the password masked)."""
    return db_command("upgrade", database, tables)


@dataclass(frozen=True)
class Record:
    """The revisions of ours a version table records for a pair of tables."""

    table: str
    revisions: list[str]
    compatible_with: dict[str, str] = field(default_factory=dict)
    """Of the recorded revisions this release does not know, those the schema table describes,
    each with the oldest revision whose code still runs on it."""
    schema: str | None = None
    """The schema table that `compatible_with` comes from."""

    @property
    def shared(self) -> bool:
        """Whether your own Alembic project recorded them (our branch in `alembic_version`)."""
        return self.table == SHARED_VERSION_TABLE

    @property
    def unknown(self) -> list[str]:
        """The recorded revisions this release does not know (a newer release wrote them)."""
        return [v for v in self.revisions if v not in REVISIONS]

    @property
    def incompatible(self) -> list[str]:
        """The unknown revisions this release cannot run on, or not known to be able to."""
        return [v for v in self.unknown if not compatible(v, self.compatible_with.get(v))]

    @property
    def malformed(self) -> dict[str, str]:
        """The unknown revisions whose recorded compatibility is not a revision id of ours."""
        return {
            v: c for v, c in self.compatible_with.items() if v in self.unknown and not is_ours(c)
        }

    @property
    def newer(self) -> bool:
        """Whether a newer release migrated the tables to a revision this release runs on."""
        return bool(self.unknown) and not self.incompatible

    @property
    def newest(self) -> str | None:
        """The newest recorded revision (one this release does not know is newer than ours)."""
        return max(self.revisions, key=revision_rank, default=None)

    def problem(self) -> str | None:
        """Why the recorded revision does not fit this release; None when it can run on it."""
        if not self.revisions:
            return f"no migration of the tables is recorded in {self.table}"
        if HEAD_REVISION in self.revisions or self.newer:
            return None
        if self.malformed:
            revision, value = next(iter(self.malformed.items()))
            return (
                f"the tables are at migration {revision} (in {self.table}), and the row of "
                f"{revision} in {self.schema} records compatible_with {value!r}, which is not a "
                "Mersal revision: this version of mersal_sqlalchemy cannot tell whether it runs "
                "on them"
            )
        needed = self.needs
        if needed:
            return (
                f"the tables are at migration {', '.join(self.unknown)} (in {self.table}), on "
                f"which only code of {needed} or later runs: this version of mersal_sqlalchemy "
                f"is at {HEAD_REVISION}"
            )
        if self.unknown:
            return (
                f"the tables are at migration {', '.join(self.unknown)} (in {self.table}), which "
                f"this version of mersal_sqlalchemy does not know (expected {HEAD_REVISION})"
            )
        return f"the tables are at migration {self.revisions[0]}, behind {HEAD_REVISION}"

    @property
    def needs(self) -> str | None:
        """The newest revision whose code an incompatible revision needs, when recorded."""
        needs = [
            self.compatible_with[v]
            for v in self.incompatible
            if v in self.compatible_with and v not in self.malformed
        ]
        return max(needs, default=None)


@dataclass
class Schema:
    """What the database holds of our tables: which exist, what they lack, their revision.

    `record` is the pair's own version table when it exists; else, with both tables there, the
    version table of earlier releases (`<outbox>_alembic_version`) if it holds a revision, or
    our revisions in your Alembic project's `alembic_version`; None when nothing of ours is
    recorded (tables made by your own migrations, or not there yet).
    """

    made_by: dict[str, str] = field(default_factory=dict)
    """Each of our tables, with the revision of ours that creates it."""
    missing_tables: list[str] = field(default_factory=list)
    missing_columns: dict[str, list[str]] = field(default_factory=dict)
    record: Record | None = None
    alembic_project: bool = False
    """Whether the database has an `alembic_version` table (your own Alembic project's)."""

    @property
    def complete(self) -> bool:
        """Whether all our tables exist with every column this release uses."""
        return not self.missing_tables and not self.missing_columns

    @property
    def gone(self) -> list[str]:
        """The missing tables that the recorded revision has (all of them when none is recorded).

        The others are missing because the tables are behind: an upgrade creates them.
        """
        newest = self.record.newest if self.record is not None else None
        return self.missing_at(newest) if newest is not None else list(self.missing_tables)

    @property
    def reached(self) -> str | None:
        """The newest revision of ours whose tables all exist (None without outbox or inbox)."""
        reached = None
        for revision in REVISIONS:
            if self.missing_at(revision):
                break
            reached = revision
        return reached

    @property
    def creatable(self) -> bool:
        """Whether creating the missing tables, and recording the head, gives the app its tables.

        Not when a column is missing, nor when a newer release or your own Alembic project
        records the tables.
        """
        if not self.missing_tables or self.missing_columns:
            return False
        return self.record is None or not (self.record.unknown or self.record.shared)

    def missing_at(self, revision: str | None) -> list[str]:
        """The missing tables that exist at `revision` (None: base, where there are none)."""
        if revision is None:
            return []
        rank = revision_rank(revision)
        return [n for n in self.missing_tables if revision_rank(self.made_by[n]) <= rank]

    def problem(self) -> str | None:
        """Why the app cannot use the tables as they are; None when it can."""
        if self.gone:
            unknown = self.record.unknown if self.record is not None else []
            if unknown and SCHEMA_REVISION in {self.made_by[name] for name in self.gone}:
                return (
                    f"the table(s) {', '.join(self.gone)} do not exist (without the schema "
                    "table, this version of mersal_sqlalchemy cannot tell whether it runs on "
                    f"{', '.join(unknown)})"
                )
            return f"the table(s) {', '.join(self.gone)} do not exist"
        if self.missing_columns:
            name, columns = next(iter(self.missing_columns.items()))
            return f"table {name} has no column(s) {', '.join(columns)}: it is out of date"
        problem = self.record.problem() if self.record is not None else None
        if problem is not None and self.missing_tables:
            problem += f" (the table(s) {', '.join(self.missing_tables)} do not exist yet)"
        return problem

    def remedy(self, database: str, tables: Tables) -> str:
        """What fixes `problem()`: the command to run, or what else to do."""
        record = self.record
        upgrade = upgrade_command(database, tables)
        if record is not None and record.malformed:
            revision = next(iter(record.malformed))
            return (
                f"set that row's compatible_with to the one in the revision file of {revision}, "
                "in the release of mersal-bus[sqlalchemy] that made it; or run that release"
            )
        if record is not None and record.unknown and not record.shared:
            release = (
                "with the release of mersal-bus[sqlalchemy] that migrated them (it knows "
                f"{', '.join(record.unknown)})"
            )
            if self.gone:
                stamp = db_command("stamp base", database, tables)
                return (
                    f"{record.table} records tables that are gone: {release}, run `{stamp}`, "
                    f"then `{upgrade}`"
                )
            if self.missing_columns:
                return f"{release}, run `{upgrade}`"
        if record is not None and record.unknown and record.needs:
            back = db_command(f"downgrade {HEAD_REVISION}", database, tables)
            return (
                "install a newer release of mersal-bus[sqlalchemy], one that knows "
                f"{record.needs}; or, to run this one, undo the migration with the release that "
                f"made it: `{back}`"
            )
        if record is not None and record.unknown:
            return (
                "install the release of mersal-bus[sqlalchemy] that migrated them, or a newer one"
            )
        if record is not None and record.shared:
            return (
                "they are migrated by your own Alembic project: run `alembic upgrade heads` "
                "there (after `alembic merge heads`, `alembic upgrade head` does it too)"
            )
        if self.gone and record is not None and record.revisions:
            stamp = db_command("stamp base", database, tables)
            return f"{record.table} records tables that are gone: run `{stamp}`, then `{upgrade}`"
        owned = self.reached is not None and record is None
        if owned and (self.missing_columns or self.alembic_project):
            return self._owned_remedy(database, tables)
        return f"run `{upgrade}`"

    def _owned_remedy(self, database: str, tables: Tables) -> str:
        """What upgrades tables that no revision of ours records (your own migrations made them)."""
        if self.alembic_project:
            return (
                f"apply revision {HEAD_REVISION} in your Alembic project: `alembic upgrade head` "
                "if it includes our versions (after `alembic merge heads` if it shows two "
                f"heads), else a migration of your own that adds the {self._lacking}"
            )
        stamp = db_command("stamp REVISION", database, tables)
        upgrade = upgrade_command(database, tables)
        return (
            f"add the {self._lacking} (see mersal_sqlalchemy/migrations/versions), or record the "
            f"revision the tables are at with `{stamp}` and run `{upgrade}`"
        )

    @property
    def _lacking(self) -> str:
        """What the tables lack, in words: "columns", "table(s)", or both."""
        lacking = ["columns"] if self.missing_columns else []
        return " and ".join(lacking + (["table(s)"] if self.missing_tables else []))

    def newer(self, database: str) -> str:
        """That a newer release migrated the tables to a revision this one runs on, in words."""
        record = self.record
        assert record is not None
        runs = ", ".join(
            f"{v} runs code of {record.compatible_with[v]} or later" for v in record.unknown
        )
        return (
            f"the tables in {mask(database)} are at migration {', '.join(record.unknown)} (in "
            f"{record.table}), newer than this version of mersal_sqlalchemy ({HEAD_REVISION}) "
            f"and compatible with it: {runs}"
        )

    def explain(self, database: str, tables: Tables) -> str | None:
        """The problem and its remedy in one message; None when there is no problem."""
        problem = self.problem()
        if problem is None:
            return None
        return f"{problem} in database {mask(database)}: {self.remedy(database, tables)}"


async def prepare_schema(engine: AsyncEngine, tables: Tables, database: str, create: bool) -> None:
    """Check that the tables exist at our revision, or create them; a ConfigurationError if not.

    With `create`, missing tables are created and the head recorded, also beside tables at an
    older revision of ours (`Schema.creatable`). A database that does not answer raises
    `Unreachable`; one that refuses, a `MersalError`.
    """
    try:
        async with engine.begin() as connection:
            schema = await connection.run_sync(read_schema, tables)
            if create and schema.creatable:
                await connection.run_sync(create_schema, tables, schema)
                schema = await connection.run_sync(read_schema, tables)
    except (OSError, TimeoutError) as error:
        raise Unreachable(
            f"cannot connect to the database at {mask(database)}: {type(error).__name__}: "
            f"{error}; is it running, and are the host and port right?"
        ) from error
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) == CANNOT_CONNECT_NOW:
            raise Unreachable(
                f"the database at {mask(database)} is starting up or shutting down: {error.orig}"
            ) from error
        raise MersalError(
            f"cannot use the database at {mask(database)}: {error.orig}; check the URL, the "
            "database name, the credentials and the user's rights"
        ) from error
    problem = schema.explain(database, tables)
    if problem is not None:
        raise ConfigurationError(problem)
    if schema.record is not None and schema.record.newer:
        log.info("%s", schema.newer(database))


def read_schema(connection: Connection, tables: Tables) -> Schema:
    """Inspect the database for our tables, their columns and their recorded revision."""
    inspector = inspect(connection)
    existing = set(inspector.get_table_names())
    schema = Schema(made_by=tables.made_by)
    for wanted in tables.migrated:
        if wanted.name not in existing:
            schema.missing_tables.append(wanted.name)
            continue
        present = {found["name"] for found in inspector.get_columns(wanted.name)}
        missing = [c.name for c in wanted.columns if c.name not in present]
        if missing:
            schema.missing_columns[wanted.name] = missing
    schema.record = _record(connection, tables, existing, schema)
    schema.alembic_project = SHARED_VERSION_TABLE in existing
    return schema


def _record(
    connection: Connection, tables: Tables, existing: set[str], found: Schema
) -> Record | None:
    """Where a revision of ours is recorded for the tables, with what the schema table says.

    The schema table is read only when it exists with its columns.
    """
    pair_exists = {tables.outbox.name, tables.inbox.name} <= existing
    record = _recorded(connection, tables, existing, pair_exists)
    readable = tables.schema.name in existing and tables.schema.name not in found.missing_columns
    if record is None or not record.unknown or not readable:
        return record
    schema = tables.schema
    rows = connection.execute(
        select(schema.c.revision, schema.c.compatible_with).where(
            schema.c.revision.in_(record.unknown)
        )
    )
    compatible_with = {str(r): str(c) for r, c in rows}
    return replace(record, compatible_with=compatible_with, schema=schema.name)


def _recorded(
    connection: Connection, tables: Tables, existing: set[str], pair_exists: bool
) -> Record | None:
    """The version table recording a revision of ours for the tables.

    The pair's own when it holds one; else, with the outbox and inbox there, the version table
    of earlier releases or your Alembic project's `alembic_version`. An empty own version table
    (left by `mersal db downgrade base`) counts only when nothing else can have made the
    tables.
    """
    own = tables.version.name
    versions = _versions(connection, own) if own in existing else None
    if versions:
        return Record(own, versions)
    if not pair_exists:
        return None  # another version table would be about other tables, or ones now gone
    legacy = legacy_version_table_name(tables.outbox.name)
    if legacy in existing:
        found = _versions(connection, legacy)
        if found:
            return Record(legacy, found)
    if SHARED_VERSION_TABLE in existing:
        ours = [v for v in _versions(connection, SHARED_VERSION_TABLE) if is_ours(v)]
        if ours:
            return Record(SHARED_VERSION_TABLE, ours)
        return None  # your Alembic project's history may have made them
    return Record(own, []) if versions is not None else None


def is_ours(revision: str) -> bool:
    """Whether a revision id is one of ours (this release's or a later one's)."""
    return revision.startswith(REVISION_PREFIX)


def _versions(connection: Connection, name: str) -> list[str]:
    version = table(name, column("version_num"))
    return [str(value) for value in connection.execute(select(version.c.version_num)).scalars()]


def recorded_elsewhere(connection: Connection, outbox: str, inbox: str) -> dict[str, str]:
    """The tables of the pair that another pair's version table records, each with that table.

    A downgrade leaves these: another pair (sharing the outbox, say) still uses them. A table
    named after the inbox (the saga and schema tables) counts as recorded by a pair sharing the
    inbox only at a revision that creates it.
    """
    existing = set(inspect(connection).get_table_names())
    own = version_table_name(outbox, inbox)
    after_inbox = {
        saga_table_name(inbox): (saga_table_name, SAGAS_SUFFIX),
        schema_table_name(inbox): (schema_table_name, SCHEMA_SUFFIX),
        dead_letters_table_name(inbox): (dead_letters_table_name, DEAD_LETTERS_SUFFIX),
    }
    found: dict[str, str] = {}
    for name, revision in made_by(outbox, inbox).items():
        if name not in existing:
            continue
        if name in after_inbox:
            candidates = _version_tables_naming_after_inbox(name, *after_inbox[name], existing)
        else:
            candidates = _version_tables_naming(name, existing)
        recording = [
            v
            for v in sorted((candidates & existing) - {own})
            if _reaches(_versions(connection, v), revision)
        ]
        if recording:
            found[name] = recording[0]
    return found


def _reaches(versions: list[str], revision: str) -> bool:
    """Whether the recorded `versions` include `revision` (one of them is it or a later one)."""
    return any(revision_rank(v) >= revision_rank(revision) for v in versions)


def _version_tables_naming(name: str, existing: set[str]) -> set[str]:
    """The version tables that would record `name` with another table that exists."""
    others = existing - {name}
    names = {legacy_version_table_name(name)}
    names |= {version_table_name(name, other) for other in others}
    names |= {version_table_name(other, name) for other in others}
    return names


def _version_tables_naming_after_inbox(
    name: str, named: Callable[[str], str], suffix: str, existing: set[str]
) -> set[str]:
    """The version tables that would record `name`, a table named after an inbox by `named`.

    `mersal_sagas` is the saga table of the inboxes `mersal_inbox` and `mersal`.
    """
    inboxes = {DEFAULT_INBOX, name.removesuffix(suffix)}
    inboxes = {inbox for inbox in inboxes if named(inbox) == name}
    return {version_table_name(other, inbox) for inbox in inboxes for other in existing - {inbox}}


def foreign_columns(connection: Connection, wanted: Table) -> list[str] | None:
    """The columns of the table named like `wanted` when they are not `wanted`'s (not ours).

    None when there is no such table, or when it has exactly `wanted`'s columns.
    """
    if wanted.name not in inspect(connection).get_table_names():
        return None
    columns = [found["name"] for found in inspect(connection).get_columns(wanted.name)]
    return None if set(columns) == {c.name for c in wanted.columns} else columns


def count_rows(connection: Connection, name: str, *, unresolved: bool = False) -> int:
    """How many rows the table `name` holds (`unresolved`: dead letters not retried or deleted)."""
    statement = select(func.count()).select_from(table(name))
    if unresolved:
        statement = statement.where(column("resolved_at").is_(None))
    return int(connection.execute(statement).scalar_one())


def create_schema(connection: Connection, tables: Tables, schema: Schema) -> None:
    """Create the missing tables and record them as migrated to our head revision.

    An older revision in the pair's own version table is replaced; one found elsewhere (the
    version table of earlier releases) is copied over as the head.
    """
    tables.metadata.create_all(connection, tables=list(tables.migrated))
    tables.version.create(connection, checkfirst=True)  # one left empty by a downgrade stays
    connection.execute(delete(tables.version))
    connection.execute(insert(tables.version).values(version_num=HEAD_REVISION))
    record_compatibility(connection, tables.schema, HEAD_REVISION, COMPATIBLE_WITH[HEAD_REVISION])


def record_compatibility(
    connection: Connection, schema: Table, revision: str, compatible_with: str
) -> None:
    """Record in the schema table that code of `compatible_with` or later runs on `revision`."""
    recorded = select(schema.c.revision).where(schema.c.revision == revision)
    if connection.execute(recorded).first() is None:
        connection.execute(
            insert(schema).values(revision=revision, compatible_with=compatible_with)
        )
