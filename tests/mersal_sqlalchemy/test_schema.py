"""The tables: migrations, `mersal db upgrade`, the check at start, configurable names.

Also two releases on one database: the schema table says which releases can run on a revision,
so an additive revision of a newer release keeps this one running and a breaking one is refused
with what it needs.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, inspect, text
from sqlalchemy.engine import make_url

from mersal import App, ConfigurationError
from mersal.cli import main
from mersal_sqlalchemy import HEAD_REVISION, attach, make_engine, make_tables
from mersal_sqlalchemy.cli import alembic_config, upgrade
from mersal_sqlalchemy.migrations import include_object_for
from mersal_sqlalchemy.tables import (
    COMPATIBLE_WITH,
    REVISIONS,
    dead_letters_table_name,
    migration_table_names,
    saga_table_name,
    schema_table_name,
    version_table_name,
)
from tests.mersal_sqlalchemy.support import (
    ORDERS,
    PlaceOrder,
    Probe,
    Ran,
    Ship,
    Sink,
    count,
    create_business_tables,
    execute,
    migrate_as_before,
    orders_app,
    run_process,
    storage_of,
)
from tests.support import eventually, sqlite_file


def describe_schema(connection: Connection) -> dict[str, Any]:
    """Tables, columns, primary keys and indexes, comparable between two databases."""
    inspector = inspect(connection)
    described: dict[str, Any] = {}
    for name in sorted(inspector.get_table_names()):
        columns = [
            (c["name"], str(c["type"]), c["nullable"], c["default"] is not None)
            for c in inspector.get_columns(name)
        ]
        indexes = sorted(
            (i["name"], tuple(i["column_names"]), bool(i["unique"]))
            for i in inspector.get_indexes(name)
        )
        primary_key = tuple(inspector.get_pk_constraint(name)["constrained_columns"])
        described[name] = {"columns": columns, "indexes": indexes, "primary_key": primary_key}
    return described


async def schema_of(database: str) -> dict[str, Any]:
    """The described schema of a database."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(describe_schema)
    finally:
        await engine.dispose()


OURS = {"mersal_outbox", "mersal_inbox", "mersal_sagas", "mersal_schema", "mersal_dead_letters"}


def with_password(url: str, password: str) -> str:
    """The same database URL with a password in it."""
    return make_url(url).set(password=password).render_as_string(hide_password=False)


@pytest.mark.integration
async def test_db_upgrade_on_an_empty_database_creates_the_tables(
    empty_postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", empty_postgres_url]) == 0
    schema = await schema_of(empty_postgres_url)
    assert set(schema) == {*OURS, "mersal_outbox_alembic_version"}
    assert ("ix_mersal_outbox_claim", ("app", "id"), False) in schema["mersal_outbox"]["indexes"]
    assert schema["mersal_inbox"]["primary_key"] == ("app", "message_id")
    sagas = schema["mersal_sagas"]
    assert sagas["primary_key"] == ("app", "saga", "correlation")
    assert sagas["indexes"] == [("ix_mersal_sagas_id", ("id",), True)]
    assert [(name, type_, nullable) for name, type_, nullable, _ in sagas["columns"]] == [
        ("app", "VARCHAR(200)", False),
        ("saga", "VARCHAR(200)", False),
        ("correlation", "VARCHAR(255)", False),
        ("id", "VARCHAR(36)", False),
        ("revision", "INTEGER", False),
        ("data", "TEXT", False),
        ("created_at", "TIMESTAMP", False),
        ("updated_at", "TIMESTAMP", False),
    ]
    dead_letters = schema["mersal_dead_letters"]
    assert dead_letters["primary_key"] == ("id",)
    assert dead_letters["indexes"] == [
        ("ix_mersal_dead_letters_app", ("app", "id"), False),
        ("ix_mersal_dead_letters_group", ("app", "group_key", "id"), False),
        ("ix_mersal_dead_letters_key", ("key",), True),
    ]
    said = f"the outbox, inbox and saga tables in {empty_postgres_url} are at mersal_0004 (head)\n"
    assert capsys.readouterr().out == said
    # a second run finds nothing to do
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", empty_postgres_url]) == 0
    assert capsys.readouterr().out == said


@pytest.mark.integration
async def test_an_app_on_a_database_without_the_tables_names_the_command(
    empty_postgres_url: str, memory_url: str
) -> None:
    database = with_password(empty_postgres_url, "s3cret")
    app = orders_app(database, memory_url, Probe())
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    message = str(raised.value)
    assert "mersal_outbox" in message and "do not exist" in message
    assert "mersal db upgrade --database" in message
    assert "s3cret" not in message and ":***@" in message
    assert not app.running


@pytest.mark.integration
@pytest.mark.parametrize(
    ("damage", "says"),
    [
        pytest.param(
            "UPDATE mersal_outbox_alembic_version SET version_num = 'mersal_0099'",
            r"at migration mersal_0099 .* does not know .*: install the release of "
            r"mersal-bus\[sqlalchemy\] that migrated them, or a newer one$",
            id="a revision of a newer release",
        ),
        pytest.param(
            "ALTER TABLE mersal_outbox DROP COLUMN parked_reason",
            r"parked_reason.*mersal db upgrade",
            id="a missing column",
        ),
    ],
)
async def test_an_app_on_tables_that_do_not_match_its_schema_fails_at_start(
    postgres_url: str, memory_url: str, damage: str, says: str
) -> None:
    engine = make_engine(postgres_url)
    async with engine.begin() as connection:
        await connection.execute(text(damage))
    await engine.dispose()
    with pytest.raises(ConfigurationError, match=says):
        await orders_app(postgres_url, memory_url, Probe()).start()


async def test_an_embedded_sqlite_app_creates_its_tables(tmp_path: Path, memory_url: str) -> None:
    database = sqlite_file(tmp_path)
    for _ in range(2):  # the second start finds them
        async with orders_app(database, memory_url, Probe()) as app:
            storage = storage_of(app)
            assert await count(storage.engine, storage.tables.outbox) == 0
    schema = await schema_of(database)
    assert set(schema) == {*OURS, "mersal_outbox_alembic_version"}


async def test_the_migrations_create_the_tables_the_code_describes(
    empty_database: str, tmp_path: Path
) -> None:
    await asyncio.to_thread(upgrade, empty_database)
    migrated = await schema_of(empty_database)
    if empty_database.startswith("sqlite"):
        described = sqlite_file(tmp_path / "described")
        (tmp_path / "described").mkdir()
    else:
        described = empty_database.replace("/mersal_test_", "/mersal_test_d_")
        await create_database_next_to(empty_database, described)
    try:
        app = App("orders", database=described, transport="memory://")
        attach(app, create_tables=True)
        await app.start()
        await app.stop()
        assert await schema_of(described) == migrated
    finally:
        if not empty_database.startswith("sqlite"):
            await drop_database_next_to(empty_database, described)


async def create_database_next_to(existing: str, new: str) -> None:
    """Create the database of URL `new` on the server of `existing`."""
    await _admin(existing, f'CREATE DATABASE "{make_url(new).database}"')


async def drop_database_next_to(existing: str, new: str) -> None:
    """Drop the database of URL `new`."""
    await _admin(existing, f'DROP DATABASE IF EXISTS "{make_url(new).database}" WITH (FORCE)')


async def _admin(url: str, statement: str) -> None:
    engine = make_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            await connection.execute(text(statement))
    finally:
        await engine.dispose()


def test_the_head_revision_in_the_code_is_the_head_of_the_migrations() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config("sqlite:///unused.db", "a", "b"))
    assert scripts.get_heads() == [HEAD_REVISION]
    walked = [script.revision for script in scripts.walk_revisions()]
    assert walked == list(reversed(REVISIONS))
    assert REVISIONS == ("mersal_0001", "mersal_0002", "mersal_0003", "mersal_0004")


def test_each_revision_declares_the_compatibility_the_code_records() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config("sqlite:///unused.db", "a", "b"))
    declared = {
        script.revision: script.module.compatible_with for script in scripts.walk_revisions()
    }
    assert declared == COMPATIBLE_WITH
    assert all(COMPATIBLE_WITH[revision] in REVISIONS for revision in REVISIONS)


@pytest.mark.parametrize(
    ("inbox", "sagas"),
    [
        ("mersal_inbox", "mersal_sagas"),
        ("billing_inbox", "billing_inbox_sagas"),
        ("Orders", "Orders_sagas"),
        ("i" * 40, "i" * 40 + "_sagas"),
    ],
)
def test_the_saga_table_is_named_after_the_inbox(inbox: str, sagas: str) -> None:
    assert saga_table_name(inbox) == sagas
    tables = make_tables("some_outbox", inbox)
    assert tables.sagas.name == sagas
    names = [sagas, f"ix_{sagas}_id", f"{sagas}_pkey"]
    assert all(len(name) <= 63 for name in names)  # PostgreSQL's identifiers


def test_the_saga_table_has_the_columns_the_saga_store_uses() -> None:
    sagas = make_tables().sagas
    assert [column.name for column in sagas.columns] == [
        "app",
        "saga",
        "correlation",
        "id",
        "revision",
        "data",
        "created_at",
        "updated_at",
    ]
    assert not any(column.nullable for column in sagas.columns)
    assert [column.name for column in sagas.primary_key] == ["app", "saga", "correlation"]
    [index] = sagas.indexes
    assert (index.name, [c.name for c in index.columns], index.unique) == (
        "ix_mersal_sagas_id",
        ["id"],
        True,
    )


@pytest.mark.parametrize(
    ("outbox", "inbox"),
    [
        ("orders_sagas", "orders"),
        ("orders_schema", "orders"),
        ("orders_dead_letters", "orders"),
        ("x", "x"),
    ],
)
def test_an_outbox_named_like_the_inbox_or_a_table_named_after_it_is_refused(
    outbox: str, inbox: str
) -> None:
    with pytest.raises(ConfigurationError, match="the outbox"):
        make_tables(outbox, inbox)
    with pytest.raises(ConfigurationError, match="the outbox"):
        migration_table_names({"outbox_table": outbox, "inbox_table": inbox})


def test_include_object_hides_the_tables_our_migrations_made_after_the_inbox() -> None:
    include = include_object_for("billing_outbox", "billing_inbox")
    tables = make_tables("billing_outbox", "billing_inbox")
    for table, other in (
        (tables.sagas, "mersal_sagas"),
        (tables.schema, "mersal_schema"),
        (tables.dead_letters, "mersal_dead_letters"),
    ):
        assert not include(table, table.name, "table", True, None)
        assert include(table, table.name, "table", True, table)  # on your metadata
        assert include(table, other, "table", True, None)  # another pair's


@pytest.mark.parametrize(
    ("outbox", "inbox", "version"),
    [
        ("mersal_outbox", "mersal_inbox", "mersal_outbox_alembic_version"),  # as it always was
        ("orders_outbox", "orders_inbox", "orders_outbox_orders_inbox_alembic_version"),
        ("mersal_outbox", "orders_inbox", "mersal_outbox_orders_inbox_alembic_version"),
        ("orders_outbox", "mersal_inbox", "orders_outbox_mersal_inbox_alembic_version"),
    ],
)
def test_each_pair_of_tables_has_a_version_table_of_its_own(
    outbox: str, inbox: str, version: str
) -> None:
    assert version_table_name(outbox, inbox) == version
    assert make_tables(outbox, inbox).version.name == version


def test_long_table_names_get_a_short_version_table_name_of_their_own() -> None:
    outbox, inbox = "o" * 40, "i" * 40
    names = {version_table_name(outbox, inbox), version_table_name(outbox, inbox[:-1])}
    assert len(names) == 2
    assert all(len(name) <= 59 and name.endswith("_alembic_version") for name in names)


@pytest.mark.parametrize("name", ["", "1outbox", "out box", "outbox;drop", "x" * 41, "a.b"])
def test_table_names_must_be_plain_identifiers(name: str) -> None:
    with pytest.raises(ConfigurationError, match="not a usable table name"):
        make_tables(outbox=name)
    with pytest.raises(ConfigurationError, match="not a usable table name"):
        attach(App("orders", database="sqlite+aiosqlite:///x.db"), inbox_table=name)


@pytest.mark.parametrize(
    ("database", "complaint"),
    [
        ("mysql+aiomysql://u:pw@host/db", "does not support"),
        ("sqlite+aiosqlite://", "in-memory"),
        ("sqlite+aiosqlite:///:memory:", "in-memory"),
        ("not a url", "not a database URL"),
    ],
)
async def test_unsupported_databases_fail_at_start(database: str, complaint: str) -> None:
    app = App("orders", database=database, transport="memory://")
    with pytest.raises(ConfigurationError, match=complaint) as raised:
        await app.start()
    assert "pw" not in str(raised.value)


@pytest.mark.integration
async def test_tables_of_other_names_work_end_to_end(postgres_url: str, memory_url: str) -> None:
    await asyncio.to_thread(
        upgrade, postgres_url, outbox_table="billing_outbox", inbox_table="billing_inbox"
    )
    sink = await Sink(memory_url).start()
    app = orders_app(
        postgres_url,
        memory_url,
        Probe(),
        outbox_table="billing_outbox",
        inbox_table="billing_inbox",
    )
    async with app:
        storage = storage_of(app)
        assert storage.tables.channel == "billing_outbox"
        async with app.transaction():
            sent = await app.send(Ship(1))
        await eventually(
            lambda: sink.ids() == [sent], "the message leaves through the custom outbox table"
        )
    unmigrated = orders_app(postgres_url, memory_url, Probe(), outbox_table="other_outbox")
    with pytest.raises(ConfigurationError, match="--outbox-table other_outbox"):
        await unmigrated.start()


@pytest.mark.parametrize(
    "shared_versions",
    [
        None,  # tables made from make_tables(metadata=...) by the user's own tooling
        ["abc123"],  # the user's own Alembic project, our tables created by it
        ["abc123", HEAD_REVISION],  # ... or by our migrations through version_locations
    ],
)
async def test_tables_migrated_by_your_own_alembic_project_are_accepted(
    tmp_path: Path, memory_url: str, shared_versions: list[str] | None
) -> None:
    database = sqlite_file(tmp_path)
    engine = make_engine(database)
    async with engine.begin() as connection:
        tables = make_tables()
        await connection.run_sync(tables.metadata.create_all)
        if shared_versions is not None:
            await connection.execute(text("CREATE TABLE alembic_version (version_num TEXT)"))
            for version in shared_versions:
                await connection.execute(
                    text("INSERT INTO alembic_version VALUES (:v)"), {"v": version}
                )
    await engine.dispose()
    app = orders_app(database, memory_url, Probe(), create_tables=False)
    async with app:
        assert app.running


async def test_a_version_table_without_a_revision_is_refused(
    tmp_path: Path, memory_url: str
) -> None:
    database = sqlite_file(tmp_path)
    await asyncio.to_thread(upgrade, database)
    engine = make_engine(database)
    async with engine.begin() as connection:
        await connection.execute(text("DELETE FROM mersal_outbox_alembic_version"))
    await engine.dispose()
    with pytest.raises(ConfigurationError, match="no migration of the tables is recorded"):
        await orders_app(database, memory_url, Probe()).start()


@pytest.mark.parametrize("how", ["create_async_engine(isolation_level=)", "execution_options()"])
async def test_an_autocommit_engine_is_refused_with_what_to_change(
    database: str, memory_url: str, how: str
) -> None:
    """Each statement committing on its own breaks the unit of work: refused at attach."""
    if how == "execution_options()":
        engine = make_engine(database).execution_options(isolation_level="AUTOCOMMIT")
    else:
        engine = make_engine(database, isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(ConfigurationError, match="AUTOCOMMIT") as raised:
            orders_app(None, memory_url, Probe(), engine=engine)
        assert "without isolation_level='AUTOCOMMIT'" in str(raised.value)
    finally:
        await engine.dispose()


async def test_an_engine_with_an_isolation_level_that_keeps_transactions_is_taken(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    engine = make_engine(database, isolation_level="SERIALIZABLE")
    try:
        async with orders_app(None, memory_url, probe, engine=engine) as app:
            await app.send(PlaceOrder("o-1", fail=True))
            await eventually(lambda: probe.calls == 1, "the handler ran once")
            await eventually(lambda: app.in_flight == 0, "the delivery settled")
            assert await count(engine, ORDERS) == 0  # its flushed row was rolled back
    finally:
        await engine.dispose()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("migrated", "names", "found"),
    [
        pytest.param("default_pair", {}, "", id="the default tables"),
        pytest.param(
            "billing_pair",
            {"outbox_table": "billing_outbox", "inbox_table": "billing_inbox"},
            "found mersal_0001 recorded in billing_outbox_alembic_version: recorded them at "
            "mersal_0001 in billing_outbox_billing_inbox_alembic_version\n",
            id="tables of other names",
        ),
    ],
)
async def test_a_database_the_release_before_migrated_is_behind_until_upgraded(
    empty_postgres_url: str,
    memory_url: str,
    capsys: pytest.CaptureFixture[str],
    migrated: str,
    names: dict[str, str],
    found: str,
) -> None:
    db = empty_postgres_url
    await migrate_as_before(db, migrated)
    flags = [part for k, v in names.items() for part in (f"--{k.replace('_', '-')}", v)]
    outbox = names.get("outbox_table", "mersal_outbox")
    sagas = saga_table_name(names.get("inbox_table", "mersal_inbox"))
    schema = schema_table_name(names.get("inbox_table", "mersal_inbox"))
    dead_letters = dead_letters_table_name(names.get("inbox_table", "mersal_inbox"))
    engine = make_engine(db)
    async with engine.begin() as connection:
        await connection.execute(
            text(
                f"INSERT INTO {outbox} (app, address, publish, headers, body) "
                "VALUES ('orders', 'sink', false, '{}', '')"
            )
        )
    await engine.dispose()
    behind = orders_app(db, memory_url, Probe(), create_tables=False, **names)
    with pytest.raises(ConfigurationError) as raised:
        await behind.start()
    upgrade_command = " ".join(["mersal db upgrade --database", f"'{db}'", *flags])
    assert str(raised.value) == (
        "the tables are at migration mersal_0001, behind mersal_0004 (the table(s) "
        f"{sagas}, {schema}, {dead_letters} do not exist yet) in database {db}: run "
        f"`{upgrade_command}`"
    )

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["db", "current", "--database", db, *flags]) == 0
    assert capsys.readouterr().out == f"mersal_0001, recorded in {outbox}_alembic_version\n"
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db, *flags]) == 0
    at_head = f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n"
    assert capsys.readouterr().out == found + at_head
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db, *flags]) == 0
    assert capsys.readouterr().out == at_head
    async with orders_app(db, memory_url, Probe(), create_tables=False, **names) as app:
        assert app.running
        assert await count(storage_of(app).engine, storage_of(app).tables.outbox) == 1


# Two releases on one database: the schema table says which releases can run on a revision.


ROOT = Path(__file__).parents[2]
PACKAGES = ("mersal", "mersal_sqlalchemy")

NEXT_REVISION = '''"""An audit table.

Revision ID: mersal_0005
Revises: mersal_0004
Create Date: 2026-06-01 00:00:00
"""

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import record_compatibility, table_names

revision = "mersal_0005"
down_revision = "mersal_0004"
branch_labels = None
depends_on = None
compatible_with = "{compatible_with}"


def upgrade() -> None:
    _, inbox = table_names()
    op.create_table(f"{{inbox}}_audit", sa.Column("id", sa.Integer(), primary_key=True))
    record_compatibility(revision, compatible_with)


def downgrade() -> None:
    _, inbox = table_names()
    op.drop_table(f"{{inbox}}_audit")
'''

RELEASE_TABLES = {  # what the newer release's tables.py says of its revisions
    'HEAD_REVISION = "mersal_0004"': 'HEAD_REVISION = "mersal_0005"',
    'REVISIONS = ("mersal_0001", "mersal_0002", "mersal_0003", HEAD_REVISION)': (
        'REVISIONS = ("mersal_0001", "mersal_0002", "mersal_0003", "mersal_0004", HEAD_REVISION)'
    ),
    '    "mersal_0004": "mersal_0001",\n}': (
        '    "mersal_0004": "mersal_0001",\n    "mersal_0005": "{compatible_with}",\n}'
    ),
}


@dataclass(frozen=True)
class Release:
    """A copy of the package tree with one revision more than this release."""

    root: Path

    async def mersal(self, *arguments: str) -> Ran:
        """Run `mersal ARGUMENTS` from this release, in a process of its own."""
        code = "import sys; from mersal.cli import main; sys.exit(main(sys.argv[1:]))"
        command = [sys.executable, "-c", code, *arguments]
        return await run_process(command, self.root, PYTHONPATH=str(self.root))


def next_release(directory: Path, compatible_with: str) -> Release:
    """This package tree with `mersal_0005`, on which code of `compatible_with` or later runs."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, directory / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    tables = directory / "mersal_sqlalchemy" / "tables.py"
    source = tables.read_text()
    for old, new in RELEASE_TABLES.items():
        assert old in source, f"tables.py no longer says {old!r}: update this test"
        source = source.replace(old, new.replace("{compatible_with}", compatible_with))
    tables.write_text(source)
    versions = directory / "mersal_sqlalchemy" / "migrations" / "versions"
    (versions / "0005_audit.py").write_text(NEXT_REVISION.format(compatible_with=compatible_with))
    return Release(directory)


async def handles_a_message(database: str, memory_url: str) -> bool:
    """Whether this release's orders app starts on `database` and handles a PlaceOrder."""
    probe = Probe()
    async with orders_app(database, memory_url, probe, create_tables=False) as app:
        async with app.transaction():
            await app.send(PlaceOrder("o-1"))
        engine = make_engine(database)

        async def stored() -> bool:
            return await count(engine, ORDERS) == 1

        try:
            # the row is there once the handler's transaction committed, after the handler ran
            await eventually(stored, "the order was stored", timeout=20)
        except AssertionError:
            return False
        finally:
            await engine.dispose()
        return probe.calls == 1


async def test_an_additive_revision_of_a_newer_release_keeps_this_release_running(
    empty_database: str,
    tmp_path: Path,
    memory_url: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = empty_database
    newer = next_release(tmp_path / "next", compatible_with="mersal_0004")
    upgraded = await newer.mersal("db", "upgrade", "--database", db)
    assert upgraded.code == 0, upgraded.err
    assert upgraded.out == f"the outbox, inbox and saga tables in {db} are at mersal_0005 (head)\n"
    await create_business_tables(db)

    caplog.set_level(logging.INFO, logger="mersal.sqlalchemy")
    assert await handles_a_message(db, memory_url)
    newer_and_compatible = (
        f"the tables in {db} are at migration mersal_0005 (in mersal_outbox_alembic_version), "
        f"newer than this version of mersal_sqlalchemy ({HEAD_REVISION}) and compatible with "
        "it: mersal_0005 runs code of mersal_0004 or later"
    )
    logged = [r for r in caplog.records if r.name == "mersal.sqlalchemy"]
    assert [(r.levelno, r.getMessage()) for r in logged][:1] == [
        (logging.INFO, newer_and_compatible)
    ]

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["db", "check", "--database", db]) == 0
    assert capsys.readouterr().out == newer_and_compatible + "\n"
    assert await asyncio.to_thread(main, ["db", "current", "--database", db]) == 0
    assert capsys.readouterr().out == (
        "mersal_0005, recorded in mersal_outbox_alembic_version (newer than this release's "
        "mersal_0004; code of mersal_0004 or later runs on it)\n"
    )
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db]) == 0
    assert capsys.readouterr().out == newer_and_compatible + ": nothing to upgrade\n"

    back = await newer.mersal("db", "downgrade", "mersal_0004", "--database", db)
    assert back.code == 0, back.err  # no --force: the revision only added a table
    assert back.out == f"the outbox, inbox and saga tables in {db} are at mersal_0004\n"
    assert await asyncio.to_thread(main, ["db", "check", "--database", db]) == 0


async def test_a_revision_that_breaks_older_code_is_refused_with_what_it_needs(
    empty_database: str, tmp_path: Path, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = empty_database
    newer = next_release(tmp_path / "next", compatible_with="mersal_0005")
    upgraded = await newer.mersal("db", "upgrade", "--database", db)
    assert upgraded.code == 0, upgraded.err
    await create_business_tables(db)

    refused = (
        "the tables are at migration mersal_0005 (in mersal_outbox_alembic_version), on which "
        "only code of mersal_0005 or later runs: this version of mersal_sqlalchemy is at "
        f"mersal_0004 in database {db}: install a newer release of mersal-bus[sqlalchemy], one "
        "that knows mersal_0005; or, to run this one, undo the migration with the release that "
        f"made it: `mersal db downgrade mersal_0004 --database '{db}'`"
    )
    app = orders_app(db, memory_url, Probe(), create_tables=False)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == refused
    assert not app.running

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["db", "check", "--database", db]) == 1
    assert capsys.readouterr().err == f"mersal: {refused}\n"
    assert await asyncio.to_thread(main, ["db", "current", "--database", db]) == 0
    assert capsys.readouterr().out == (
        "mersal_0005, recorded in mersal_outbox_alembic_version (newer than this release's "
        "mersal_0004; it needs code of mersal_0005 or later)\n"
    )
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db]) == 2
    assert capsys.readouterr().err == f"mersal: {refused}\n"

    command = shlex.split(refused.rsplit("`", 2)[1])[1:]  # what the message says to run, there
    back = await newer.mersal(*command)
    assert back.code == 0, back.err
    assert await handles_a_message(db, memory_url)


AT_NEXT = "UPDATE mersal_outbox_alembic_version SET version_num = 'mersal_0005'"
"""What a newer release's upgrade records, without its revision (the tables stay as they are)."""

WITH_THE_NEWER_RELEASE = (
    "with the release of mersal-bus[sqlalchemy] that migrated them (it knows mersal_0005), run "
)

BROKEN_SCHEMA_TABLES = {
    "renamed column": (
        ["ALTER TABLE mersal_schema RENAME COLUMN compatible_with TO cw"],
        "table mersal_schema has no column(s) compatible_with: it is out of date in database "
        "{db}: " + WITH_THE_NEWER_RELEASE + "`mersal db upgrade --database '{db}'`",
        ", or unknown to it; no compatibility recorded)",
    ),
    "not a revision": (
        ["INSERT INTO mersal_schema VALUES ('mersal_0005', 'garbage')"],
        "the tables are at migration mersal_0005 (in mersal_outbox_alembic_version), and the "
        "row of mersal_0005 in mersal_schema records compatible_with 'garbage', which is not a "
        "Mersal revision: this version of mersal_sqlalchemy cannot tell whether it runs on them "
        "in database {db}: set that row's compatible_with to the one in the revision file of "
        "mersal_0005, in the release of mersal-bus[sqlalchemy] that made it; or run that release",
        "; the compatible_with recorded for mersal_0005 in mersal_schema, 'garbage', is not a "
        "Mersal revision)",
    ),
    "missing": (
        ["DROP TABLE mersal_schema"],
        "the table(s) mersal_schema do not exist (without the schema table, this version of "
        "mersal_sqlalchemy cannot tell whether it runs on mersal_0005) in database {db}: "
        "mersal_outbox_alembic_version records tables that are gone: "
        + WITH_THE_NEWER_RELEASE
        + "`mersal db stamp base --database '{db}'`, then `mersal db upgrade --database '{db}'`",
        ", or unknown to it; no compatibility recorded)",
    ),
}


@pytest.mark.parametrize("broken", BROKEN_SCHEMA_TABLES)
async def test_a_broken_schema_table_at_a_newer_revision_is_refused_saying_what_is_wrong(
    empty_database: str, memory_url: str, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    db = empty_database
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db]) == 0
    statements, refused, compatibility = BROKEN_SCHEMA_TABLES[broken]
    await execute(db, AT_NEXT, *statements)
    refused = refused.format(db=db)

    app = orders_app(db, memory_url, Probe(), create_tables=False)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == refused

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["db", "check", "--database", db]) == 1
    assert capsys.readouterr().err == f"mersal: {refused}\n"
    assert await asyncio.to_thread(main, ["db", "current", "--database", db]) == 0
    assert capsys.readouterr().out == (
        "mersal_0005, recorded in mersal_outbox_alembic_version (newer than this release's "
        f"mersal_0004{compatibility}\n"
    )
