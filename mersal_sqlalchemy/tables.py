"""The outbox, inbox and saga tables (SQLAlchemy Core), under names you can choose."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    func,
    text,
)

from mersal.errors import ConfigurationError

DEFAULT_OUTBOX = "mersal_outbox"
DEFAULT_INBOX = "mersal_inbox"
DEFAULT_SAGAS = "mersal_sagas"
SAGAS_SUFFIX = "_sagas"
DEFAULT_SCHEMA = "mersal_schema"
SCHEMA_SUFFIX = "_schema"
DEFAULT_DEAD_LETTERS = "mersal_dead_letters"
DEAD_LETTERS_SUFFIX = "_dead_letters"

HEAD_REVISION = "mersal_0004"
"""The Alembic revision (in migrations/versions) the tables below correspond to."""

REVISIONS = ("mersal_0001", "mersal_0002", "mersal_0003", HEAD_REVISION)
"""Every revision of ours, oldest first."""

PAIR_REVISION, SAGAS_REVISION, SCHEMA_REVISION, DEAD_LETTERS_REVISION = REVISIONS[:4]
"""The revisions that create the outbox and inbox, the sagas, schema and dead-letter tables."""

COMPATIBLE_WITH = {
    "mersal_0001": "mersal_0001",
    "mersal_0002": "mersal_0001",
    "mersal_0003": "mersal_0001",
    "mersal_0004": "mersal_0001",
}
"""Each revision of ours, with the oldest revision whose code still runs on it.

The same as each revision file's `compatible_with`, and what it records in the schema table.
"""

APP_LENGTH = 200
MESSAGE_ID_LENGTH = 255
CORRELATION_LENGTH = 255
SAGA_NAME_LENGTH = 200
SAGA_ID_LENGTH = 36
REVISION_LENGTH = 32
DIGEST_LENGTH = 64

VERSION_SUFFIX = "alembic_version"
VERSION_NAME_LENGTH = 59

OUTBOX_OPTION = "mersal_outbox_table"
INBOX_OPTION = "mersal_inbox_table"
"""The `alembic.ini` options naming the tables when our revisions run in your Alembic project."""

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def check_identifier(name: object, what: str) -> str:
    """`name` if it is a plain SQL identifier; a ConfigurationError if it is not."""
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} = {name!r} is not a usable table name: use 1-40 letters, digits and '_', "
            "not starting with a digit"
        )
    return name


def migration_table_names(
    arguments: Mapping[str, str], options: Mapping[str, str | None] | None = None
) -> tuple[str, str]:
    """The outbox and inbox names a migration works on.

    From Alembic's `-x outbox_table=... -x inbox_table=...` arguments first, then from
    `options` (the `mersal_outbox_table` and `mersal_inbox_table` options of `alembic.ini`),
    then the defaults.
    """
    options = options or {}
    outbox = arguments.get("outbox_table") or options.get(OUTBOX_OPTION) or DEFAULT_OUTBOX
    inbox = arguments.get("inbox_table") or options.get(INBOX_OPTION) or DEFAULT_INBOX
    check_identifier(outbox, f"-x outbox_table (or {OUTBOX_OPTION})")
    check_identifier(inbox, f"-x inbox_table (or {INBOX_OPTION})")
    check_pair(outbox, inbox)
    return outbox, inbox


def check_pair(outbox: str, inbox: str) -> None:
    """A ConfigurationError unless the outbox, the inbox and its saga table are three tables."""
    if outbox == inbox:
        raise ConfigurationError(f"the outbox and the inbox need two tables, not both {outbox!r}")
    after_inbox = (
        ("saga", saga_table_name(inbox)),
        ("schema", schema_table_name(inbox)),
        ("dead-letter", dead_letters_table_name(inbox)),
    )
    for what, name in after_inbox:
        if outbox == name:
            raise ConfigurationError(
                f"the outbox {outbox!r} would be the {what} table of the inbox {inbox!r}: "
                "choose another name for one of them"
            )


def saga_table_name(inbox: str) -> str:
    """The saga table of the storage whose inbox is `inbox`.

    `mersal_sagas` beside the default inbox, else `<inbox>_sagas`. It follows the inbox, not a
    name of its own, so that our revisions need no `-x` option for it and each pair's version
    table records it with the inbox. At most 46 characters (inbox names have 40), so that its
    index `ix_<name>_id` fits PostgreSQL's 63.
    """
    check_identifier(inbox, "inbox table")
    return DEFAULT_SAGAS if inbox == DEFAULT_INBOX else f"{inbox}{SAGAS_SUFFIX}"


def schema_table_name(inbox: str) -> str:
    """The table recording which releases can run on the tables of the inbox `inbox`.

    `mersal_schema` beside the default inbox, else `<inbox>_schema`: it follows the inbox, as
    the saga table does.
    """
    check_identifier(inbox, "inbox table")
    return DEFAULT_SCHEMA if inbox == DEFAULT_INBOX else f"{inbox}{SCHEMA_SUFFIX}"


def dead_letters_table_name(inbox: str) -> str:
    """The dead-letter store of the storage whose inbox is `inbox`.

    `mersal_dead_letters` beside the default inbox, else `<inbox>_dead_letters` (at most 53
    characters, so that its indexes' names fit PostgreSQL's 63).
    """
    check_identifier(inbox, "inbox table")
    return DEFAULT_DEAD_LETTERS if inbox == DEFAULT_INBOX else f"{inbox}{DEAD_LETTERS_SUFFIX}"


def made_by(outbox: str, inbox: str) -> dict[str, str]:
    """The pair's tables (its version table aside), each with the revision of ours creating it."""
    return {
        outbox: PAIR_REVISION,
        inbox: PAIR_REVISION,
        saga_table_name(inbox): SAGAS_REVISION,
        schema_table_name(inbox): SCHEMA_REVISION,
        dead_letters_table_name(inbox): DEAD_LETTERS_REVISION,
    }


def compatible(revision: str, compatible_with: str | None) -> bool:
    """Whether this release can run on tables at `revision`, which runs code at `compatible_with`.

    A revision of ours it knows is the head or behind it (a separate question); one it does
    not know runs this release's code if the oldest code it runs is not newer than ours.
    """
    return revision in REVISIONS or compatible_with in REVISIONS


def revision_rank(revision: str) -> int:
    """Where `revision` comes among ours, oldest first; one we do not know comes last."""
    return REVISIONS.index(revision) if revision in REVISIONS else len(REVISIONS)


def version_table_name(outbox: str, inbox: str) -> str:
    """The Alembic version table that records the migrations of the pair `outbox`, `inbox`.

    The default pair keeps `mersal_outbox_alembic_version`; any other pair gets
    `<outbox>_<inbox>_alembic_version`, shortened with a digest of both names past 59
    characters (so that Alembic's `<name>_pkc` fits PostgreSQL's 63).
    """
    if (outbox, inbox) == (DEFAULT_OUTBOX, DEFAULT_INBOX):
        return legacy_version_table_name(outbox)
    name = f"{outbox}_{inbox}_{VERSION_SUFFIX}"
    if len(name) <= VERSION_NAME_LENGTH:
        return name
    digest = hashlib.sha256(f"{outbox} {inbox}".encode()).hexdigest()[:8]
    return f"{outbox[:16]}_{inbox[:16]}_{digest}_{VERSION_SUFFIX}"


def migration_lock_key() -> int:
    """The PostgreSQL advisory lock key that serializes our migrations in a database.

    One key for every pair, not one per version table: pairs may share a table, and two pairs
    creating the same outbox at once would collide.
    """
    digest = hashlib.sha256(f"mersal migrations {VERSION_SUFFIX}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def legacy_version_table_name(outbox: str) -> str:
    """The version table of earlier releases, keyed on the outbox alone (read, never written)."""
    return f"{outbox}_{VERSION_SUFFIX}"


@dataclass(frozen=True)
class Tables:
    """One storage's outbox, inbox and saga tables, and the table recording their migrations."""

    metadata: MetaData
    outbox: Table
    inbox: Table
    version: Table
    sagas: Table
    schema: Table
    dead_letters: Table

    @property
    def channel(self) -> str:
        """The PostgreSQL NOTIFY channel that announces new outbox rows (the outbox's name)."""
        return self.outbox.name

    @property
    def migrated(self) -> tuple[Table, ...]:
        """The tables our revisions create (the version table aside), oldest first."""
        return (self.outbox, self.inbox, self.sagas, self.schema, self.dead_letters)

    @property
    def made_by(self) -> dict[str, str]:
        """Each table's name (the version table aside), with the revision of ours creating it."""
        return made_by(self.outbox.name, self.inbox.name)


def make_tables(
    outbox: str = DEFAULT_OUTBOX,
    inbox: str = DEFAULT_INBOX,
    metadata: MetaData | None = None,
) -> Tables:
    """The outbox, inbox and saga tables on `metadata` (a new MetaData unless given).

    The saga and schema tables are named after the inbox (`saga_table_name`,
    `schema_table_name`). The version table stays on a MetaData of its own: Alembic keeps it,
    not your models.
    """
    check_identifier(outbox, "outbox table")
    check_identifier(inbox, "inbox table")
    check_pair(outbox, inbox)
    metadata = metadata if metadata is not None else MetaData()
    return Tables(
        metadata,
        outbox_table(outbox, metadata),
        inbox_table(inbox, metadata),
        version_table(version_table_name(outbox, inbox), MetaData()),
        saga_table(saga_table_name(inbox), metadata),
        schema_table(schema_table_name(inbox), metadata),
        dead_letters_table(dead_letters_table_name(inbox), metadata),
    )


def serial_id() -> Column[int]:
    """A table's `id`: a 64-bit serial primary key (SQLite's integer rowid)."""
    return Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )


def outbox_table(name: str, metadata: MetaData) -> Table:
    """The outbox: one row per committed outgoing message, until the broker confirms it."""
    table = Table(
        check_identifier(name, "outbox table"),
        metadata,
        serial_id(),
        Column("app", String(APP_LENGTH), nullable=False),
        Column("address", Text, nullable=False),
        Column("publish", Boolean, nullable=False),
        Column("headers", Text, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("lease_until", DateTime(timezone=True), nullable=True),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("parked_reason", Text, nullable=True),
        Column("parked_at", DateTime(timezone=True), nullable=True),
    )
    unparked = table.c.parked_at.is_(None)
    Index(
        f"ix_{name}_claim",
        table.c.app,
        table.c.id,
        postgresql_where=unparked,
        sqlite_where=unparked,
    )
    return table


def inbox_table(name: str, metadata: MetaData) -> Table:
    """The inbox: the ids of the messages each app has handled, kept for the retention window."""
    table = Table(
        check_identifier(name, "inbox table"),
        metadata,
        Column("app", String(APP_LENGTH), nullable=False),
        Column("message_id", String(MESSAGE_ID_LENGTH), nullable=False),
        Column("handled_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("app", "message_id"),
    )
    Index(f"ix_{name}_handled_at", table.c.handled_at)
    return table


def saga_table(name: str, metadata: MetaData) -> Table:
    """The sagas: one row per running saga of each app, found by its correlation or its id.

    `correlation` is stored as the inbox stores message ids (a digest when too long), `id` is
    the instance's UUID as text, `revision` counts its updates (optimistic concurrency) and
    `data` is its state as JSON.
    """
    table = Table(
        name,
        metadata,
        Column("app", String(APP_LENGTH), nullable=False),
        Column("saga", String(SAGA_NAME_LENGTH), nullable=False),
        Column("correlation", String(CORRELATION_LENGTH), nullable=False),
        Column("id", String(SAGA_ID_LENGTH), nullable=False),
        Column("revision", Integer, nullable=False),
        Column("data", Text, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("app", "saga", "correlation"),
    )
    Index(f"ix_{name}_id", table.c.id, unique=True)
    return table


def schema_table(name: str, metadata: MetaData) -> Table:
    """The schema table: each revision of ours applied, with the oldest revision it runs code of.

    An older release that finds a revision it does not know reads here whether it can run on
    it, without that revision's file.
    """
    return Table(
        name,
        metadata,
        Column("revision", String(REVISION_LENGTH), primary_key=True),
        Column("compatible_with", String(REVISION_LENGTH), nullable=False),
    )


RESOLUTION_LENGTH = 16
"""Room for a dead letter's resolution: `retried` or `deleted`."""


def dead_letters_table(name: str, metadata: MetaData) -> Table:
    """The dead-letter store: the messages ingested from the error queues, until retried or deleted.

    `key` is a digest of the message as it came from its error queue (one row per dead letter,
    however often it is delivered); `group_key` digests its failure group, which `group_label`
    names. `headers` is the JSON object of its headers, `body` its bytes as they came. A
    retried or deleted row stays a while as a tombstone (`resolved_at`, `resolution`, its
    headers and body emptied): a delivery of the same message again, after a crash between the
    commit of its row and its ack, meets the key and is not stored a second time.
    """
    table = Table(
        name,
        metadata,
        serial_id(),
        Column("app", String(APP_LENGTH), nullable=False),
        Column("key", String(DIGEST_LENGTH), nullable=False),
        Column("error_queue", Text, nullable=False),
        Column("source_queue", Text, nullable=True),
        Column("message_id", Text, nullable=True),
        Column("type_name", Text, nullable=True),
        Column("error_type", Text, nullable=True),
        Column("error_message", Text, nullable=True),
        Column("traceback", Text, nullable=True),
        Column("handler", Text, nullable=True),
        Column("attempts", Integer, nullable=True),
        Column("failed_at", DateTime(timezone=True), nullable=True),
        Column("ingested_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("group_key", String(DIGEST_LENGTH), nullable=False),
        Column("group_label", Text, nullable=False),
        Column("headers", Text, nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("resolved_at", DateTime(timezone=True), nullable=True),
        Column("resolution", String(RESOLUTION_LENGTH), nullable=True),
        sqlite_autoincrement=True,
    )
    Index(f"ix_{name}_key", table.c.key, unique=True)
    Index(f"ix_{name}_group", table.c.app, table.c.group_key, table.c.id)
    Index(f"ix_{name}_app", table.c.app, table.c.id)
    return table


def version_table(name: str, metadata: MetaData) -> Table:
    """A table shaped like Alembic's version table."""
    return Table(
        name,
        metadata,
        Column("version_num", String(32), nullable=False),
        PrimaryKeyConstraint("version_num", name=f"{name}_pkc"),
    )
