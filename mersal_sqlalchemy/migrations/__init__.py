"""Our Alembic migrations, and what your own Alembic project needs to include them.

In your `env.py`, pass `include_object` to `context.configure`, so that autogenerate and
`alembic check` leave our tables and version tables alone; to run our revisions from your
project, add `VERSIONS_RESOURCE` (`mersal_sqlalchemy.migrations:versions`, Alembic's
package-resource form) to your `version_locations`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import MetaData, Table, inspect
from sqlalchemy.sql.schema import SchemaItem

from mersal.errors import MersalError
from mersal.urls import mask
from mersal_sqlalchemy import schema as schema_check
from mersal_sqlalchemy.schema import foreign_columns, recorded_elsewhere
from mersal_sqlalchemy.tables import (
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    INBOX_OPTION,
    OUTBOX_OPTION,
    legacy_version_table_name,
    made_by,
    migration_table_names,
    schema_table,
    schema_table_name,
    version_table_name,
)

SCRIPTS = Path(__file__).resolve().parent
"""Our Alembic script directory (env.py and versions), as `mersal db` uses it."""

VERSIONS = SCRIPTS / "versions"
"""Our revisions' directory, where this installation has it."""

VERSIONS_RESOURCE = "mersal_sqlalchemy.migrations:versions"
"""Our revisions as a package resource: what to add to your `version_locations`.

Alembic finds the directory wherever the package is installed, so the setting survives a new
virtualenv, a Docker image or a Python upgrade, which an absolute path does not.
"""

IncludeObject = Callable[[SchemaItem, str | None, str, bool, SchemaItem | None], bool]


@functools.cache
def include_object_for(outbox: str = DEFAULT_OUTBOX, inbox: str = DEFAULT_INBOX) -> IncludeObject:
    """An Alembic `include_object` hook that keeps autogenerate off these tables of ours.

    It hides their version tables always, and the outbox, inbox and saga tables when they are
    in the database but not on your metadata (created by our migrations: the saga and schema
    tables follow the inbox's name); when you put them on
    your metadata (`make_tables(metadata=...)`), they are compared like your own tables.
    """
    versions = {version_table_name(outbox, inbox), legacy_version_table_name(outbox)}
    tables = {outbox, inbox, *made_by(outbox, inbox)}

    def include(
        item: SchemaItem,
        name: str | None,
        type_: str,
        reflected: bool,
        compare_to: SchemaItem | None,
    ) -> bool:
        if type_ != "table":
            return True
        if name in versions:
            return False
        return not (reflected and compare_to is None and name in tables)

    return include


def include_object(
    item: SchemaItem,
    name: str | None,
    type_: str,
    reflected: bool,
    compare_to: SchemaItem | None,
) -> bool:
    """Alembic's `include_object` hook for our tables, named as our revisions name them.

    That is by `-x outbox_table=... -x inbox_table=...`, else by the `mersal_outbox_table` and
    `mersal_inbox_table` options of your `alembic.ini`, else `mersal_outbox` and
    `mersal_inbox` (the saga table follows the inbox); see `include_object_for`.
    """
    return include_object_for(*table_names())(item, name, type_, reflected, compare_to)


def table_names() -> tuple[str, str]:
    """The outbox and inbox names the running migration works on (for our revision files).

    From `-x outbox_table=... -x inbox_table=...`, then the `mersal_outbox_table` and
    `mersal_inbox_table` options of the `alembic.ini` in use, then the defaults.
    """
    from alembic import context  # only while Alembic runs: `mersal` starts without it

    config = context.config
    options = {name: config.get_main_option(name) for name in (OUTBOX_OPTION, INBOX_OPTION)}
    return migration_table_names(context.get_x_argument(as_dictionary=True), options)


def existing(offline: set[str]) -> set[str]:
    """The tables in the database (for our revision files); when printing the SQL, `offline`."""
    from alembic import context, op

    if context.is_offline_mode():
        return offline
    return set(inspect(op.get_bind()).get_table_names())


def shared(outbox: str, inbox: str) -> dict[str, str]:
    """The pair's tables that another pair's version table records (for our revision files).

    A downgrade leaves them. When printing the SQL it cannot look: none.
    """
    from alembic import context, op

    if context.is_offline_mode():
        return {}
    return recorded_elsewhere(op.get_bind(), outbox, inbox)


def adopted(wanted: Table, what: str) -> bool:
    """Whether `wanted` exists already, as ours, so the revision leaves it (for our revision files).

    Ours: another pair sharing the inbox records it (at a later revision it may have more
    columns), or it has the columns the revision creates. A table of that name with other
    columns is someone else's: a MersalError naming it. When printing the SQL: False.
    """
    from alembic import op

    if wanted.name not in existing(offline=set()):
        return False
    if wanted.name in shared(*table_names()):
        return True
    bind = op.get_bind()
    columns = foreign_columns(bind, wanted)
    if columns is None:
        return True
    database = mask(bind.engine.url.render_as_string(hide_password=False))
    raise MersalError(
        f"the table {wanted.name} in {database} is not Mersal's {what} table: it has the "
        f"column(s) {', '.join(columns)}, where Mersal's has "
        f"{', '.join(c.name for c in wanted.columns)}; Mersal names its {what} table after the "
        f"inbox {table_names()[1]}: rename your table, or give Mersal's tables another inbox "
        "(--inbox-table here, inbox_table= in the app)"
    )


def droppable(wanted: Table) -> bool:
    """Whether undoing the revision drops `wanted` (for our revision files).

    Only a table of ours (`adopted`) that exists and that no other pair records. When printing
    the SQL it cannot look: True.
    """
    from alembic import context, op

    if context.is_offline_mode():
        return True
    if wanted.name not in existing(offline=set()) or wanted.name in shared(*table_names()):
        return False
    return foreign_columns(op.get_bind(), wanted) is None


def record_compatibility(revision: str, compatible_with: str) -> None:
    """Record that code of `compatible_with` or later runs on `revision` (for our revision files).

    Every revision from `mersal_0003` on calls it at the end of its `upgrade()`, with its own
    `revision` and `compatible_with`: an older release that finds the revision reads there
    whether it can run on the tables, without the revision's file.
    """
    from alembic import context, op

    _, inbox = table_names()
    schema = schema_table(schema_table_name(inbox), MetaData())
    if context.is_offline_mode():
        op.bulk_insert(schema, [{"revision": revision, "compatible_with": compatible_with}])
        return
    schema_check.record_compatibility(op.get_bind(), schema, revision, compatible_with)
