"""`mersal db upgrade|downgrade|stamp|current|check|history`: what each does and says.

Also: `--sql` without a database, tables of one's own recorded instead of created again, a
version table per pair of tables (a migrated outbox beside an unmigrated inbox), and tables
dropped behind a recorded revision.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from uuid import uuid4

import pytest
from sqlalchemy import insert, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from mersal import ConfigurationError
from mersal.cli import main
from mersal_sqlalchemy import make_engine, make_tables
from mersal_sqlalchemy.tables import version_table_name
from tests.mersal_sqlalchemy.support import (
    Probe,
    Ran,
    execute,
    migrate_as_before,
    orders_app,
    storage_of,
)
from tests.support import sqlite_file

Mersal = Callable[..., Awaitable[Ran]]

OURS = {"mersal_outbox", "mersal_inbox", "mersal_sagas", "mersal_schema", "mersal_dead_letters"}


@pytest.fixture
def mersal(capsys: pytest.CaptureFixture[str]) -> Mersal:
    """Run `mersal ARGUMENTS` in process; returns a Ran."""

    async def run(*arguments: str) -> Ran:
        capsys.readouterr()
        code = await asyncio.to_thread(main, list(arguments))
        out, err = capsys.readouterr()
        return Ran(code, out, err)

    return run


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands take the database from their arguments only."""
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)


async def tables_in(database: str) -> set[str]:
    """The tables in `database`."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def start_error(database: str, memory_url: str, **options: str) -> str:
    """The ConfigurationError the orders app fails to start with."""
    app = orders_app(database, memory_url, Probe(), create_tables=False, **options)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    return str(raised.value)


async def starts(database: str, memory_url: str, **options: str) -> bool:
    """Whether the orders app starts on `database`."""
    async with orders_app(database, memory_url, Probe(), create_tables=False, **options) as app:
        return app.running


def suggested(message: str) -> list[list[str]]:
    """The `mersal ...` commands a message suggests, in order, as argument lists."""
    return [shlex.split(command)[1:] for command in re.findall(r"`(mersal [^`]*)`", message)]


@pytest.mark.integration
async def test_an_empty_database_is_reported_and_stamping_it_is_refused(
    empty_postgres_url: str, mersal: Mersal
) -> None:
    db = empty_postgres_url
    current = await mersal("db", "current", "--database", db)
    assert (current.code, current.out) == (
        0,
        "no revision recorded; the table(s) mersal_outbox, mersal_inbox, mersal_sagas, "
        "mersal_schema, mersal_dead_letters do not exist\n",
    )
    check = await mersal("db", "check", "--database", db)
    assert check.code == 1
    assert check.said == (
        "mersal: the table(s) mersal_outbox, mersal_inbox, mersal_sagas, mersal_schema, "
        f"mersal_dead_letters do not exist in database {db}: run `mersal db upgrade --database "
        f"'{db}'`"
    )
    stamp = await mersal("db", "stamp", "--database", db)
    assert stamp.code == 2
    assert stamp.said == (
        "mersal: the table(s) mersal_outbox, mersal_inbox, mersal_sagas, mersal_schema, "
        f"mersal_dead_letters do not exist in {db}: create them with `mersal db upgrade "
        f"--database '{db}'` rather than record a revision for them"
    )
    assert await tables_in(db) == set()


async def test_upgrade_current_check_stamp_and_downgrade_in_turn(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    run = mersal
    at_head = f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n"
    at_base = f"the outbox, inbox and saga tables in {db} are at base (no revision recorded)\n"

    upgraded = await run("db", "upgrade", "--database", db)
    assert (upgraded.code, upgraded.out) == (0, at_head)
    assert await tables_in(db) == {*OURS, "mersal_outbox_alembic_version"}
    current = await run("db", "current", "--database", db)
    assert current.out == "mersal_0004 (head), recorded in mersal_outbox_alembic_version\n"
    check = await run("db", "check", "--database", db)
    assert (check.code, check.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are up to date\n",
    )

    assert (await run("db", "stamp", "base", "--database", db)).out == at_base
    check = await run("db", "check", "--database", db)
    assert check.code == 1
    assert check.said == (
        "mersal: no migration of the tables is recorded in mersal_outbox_alembic_version in "
        f"database {db}: run `mersal db upgrade --database '{db}'`"
    )
    assert (await run("db", "stamp", "--database", db)).out == at_head

    assert (await run("db", "downgrade", "base", "--database", db)).out == at_base
    assert await tables_in(db) == {"mersal_outbox_alembic_version"}
    again = await run("db", "downgrade", "base", "--database", db)
    assert again.code == 2
    assert again.said == (
        "mersal: no revision of ours is recorded for mersal_outbox and mersal_inbox in "
        f"{db}: there is nothing to downgrade"
    )
    assert (await run("db", "upgrade", "--database", db)).out == at_head


async def test_history_lists_our_revisions_without_a_database(mersal: Mersal) -> None:
    history = await mersal("db", "history")
    assert (history.code, history.out) == (
        0,
        "mersal_0003 -> mersal_0004 (mersal) (head), The dead-letter store.\n"
        "mersal_0002 -> mersal_0003 (mersal), The schema table: which releases can run on the "
        "tables.\n"
        "mersal_0001 -> mersal_0002 (mersal), The saga table.\n"
        "<base> -> mersal_0001 (mersal), The outbox and inbox tables.\n",
    )


async def test_commands_on_a_missing_sqlite_file_do_not_create_it(
    tmp_path: Path, mersal: Mersal
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'none.db'}"
    for command in ("current", "check", "stamp"):
        ran = await mersal("db", command, "--database", db)
        assert (ran.code, ran.said) == (2, f"mersal: there is no SQLite database at {db}")
    ran = await mersal("db", "downgrade", "base", "--database", db)
    assert (ran.code, ran.said) == (2, f"mersal: there is no SQLite database at {db}")
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize(
    ("arguments", "printed"),
    [
        pytest.param(
            ["upgrade", "--sql", "--dialect", "postgresql"],
            [
                "BEGIN;",
                "CREATE TABLE mersal_outbox_alembic_version (",
                "CREATE TABLE mersal_outbox (\n    id BIGSERIAL NOT NULL, ",
                "CREATE INDEX ix_mersal_outbox_claim ON mersal_outbox (app, id) "
                "WHERE parked_at IS NULL;",
                "CREATE TABLE mersal_inbox (",
                "INSERT INTO mersal_outbox_alembic_version (version_num) VALUES ('mersal_0001')",
                "CREATE TABLE mersal_sagas (",
                "PRIMARY KEY (app, saga, correlation)",
                "CREATE UNIQUE INDEX ix_mersal_sagas_id ON mersal_sagas (id);",
                "UPDATE mersal_outbox_alembic_version SET version_num='mersal_0002' WHERE "
                "mersal_outbox_alembic_version.version_num = 'mersal_0001';",
                "CREATE TABLE mersal_dead_letters (",
                "CREATE UNIQUE INDEX ix_mersal_dead_letters_key ON mersal_dead_letters (key);",
                "INSERT INTO mersal_schema (revision, compatible_with) VALUES ('mersal_0004', "
                "'mersal_0001');",
                "UPDATE mersal_outbox_alembic_version SET version_num='mersal_0004' WHERE "
                "mersal_outbox_alembic_version.version_num = 'mersal_0003';",
                "COMMIT;",
            ],
            id="upgrade for PostgreSQL",
        ),
        pytest.param(
            ["upgrade", "--sql", "--dialect", "sqlite"],
            ["CREATE TABLE mersal_outbox (\n    id INTEGER NOT NULL, "],
            id="upgrade for SQLite",
        ),
        pytest.param(
            [
                "upgrade",
                "--sql",
                "--database",
                "postgresql+asyncpg://u:secret@192.0.2.1:1/nowhere",
                "--outbox-table",
                "orders_outbox",
                "--inbox-table",
                "orders_inbox",
            ],
            [
                "CREATE TABLE orders_outbox_orders_inbox_alembic_version (",
                "CREATE TABLE orders_outbox (",
                "CREATE TABLE orders_inbox (",
                "CREATE TABLE orders_inbox_sagas (",
                "CREATE UNIQUE INDEX ix_orders_inbox_sagas_id ON orders_inbox_sagas (id);",
                "CREATE TABLE orders_inbox_dead_letters (",
            ],
            id="a URL only for its dialect, and other names",
        ),
        pytest.param(
            ["downgrade", "--sql", "head:base", "--dialect", "postgresql"],
            [
                "DROP INDEX ix_mersal_dead_letters_key;\n\nDROP TABLE mersal_dead_letters;",
                "UPDATE mersal_outbox_alembic_version SET version_num='mersal_0003' WHERE "
                "mersal_outbox_alembic_version.version_num = 'mersal_0004';",
                "DROP INDEX ix_mersal_sagas_id;\n\nDROP TABLE mersal_sagas;",
                "DROP TABLE mersal_inbox;",
                "DROP TABLE mersal_outbox;",
                "DELETE FROM mersal_outbox_alembic_version WHERE "
                "mersal_outbox_alembic_version.version_num = 'mersal_0001';",
            ],
            id="downgrade",
        ),
        pytest.param(
            ["stamp", "--sql", "--dialect", "sqlite"],
            ["INSERT INTO mersal_outbox_alembic_version (version_num) VALUES ('mersal_0004')"],
            id="stamp",
        ),
    ],
)
async def test_sql_is_printed_without_a_database(
    mersal: Mersal, arguments: list[str], printed: list[str]
) -> None:
    began = time.monotonic()
    ran = await mersal("db", *arguments)
    assert ran.code == 0, ran.err
    for part in printed:
        assert part in ran.out
    assert "secret" not in ran.out + ran.err
    assert time.monotonic() - began < 10  # no connection was tried (192.0.2.1 never answers)


async def test_sql_between_the_revisions_touches_only_the_saga_table(mersal: Mersal) -> None:
    up = await mersal("db", "upgrade", "--sql", "--dialect", "sqlite", "--revision", "mersal_0001")
    assert up.code == 0, up.err
    assert "CREATE TABLE mersal_inbox (" in up.out
    assert "sagas" not in up.out
    assert "mersal_0002" not in up.out

    down = await mersal(
        "db", "downgrade", "--sql", "mersal_0002:mersal_0001", "--dialect", "sqlite"
    )
    assert down.code == 0, down.err
    dropped = re.findall(r"^DROP TABLE (\w+);$", down.out, re.MULTILINE)
    assert dropped == ["mersal_sagas"]
    assert (
        "UPDATE mersal_outbox_alembic_version SET version_num='mersal_0001' WHERE "
        "mersal_outbox_alembic_version.version_num = 'mersal_0002';"
    ) in down.out


async def test_sql_without_a_dialect_says_what_it_needs(mersal: Mersal) -> None:
    ran = await mersal("db", "upgrade", "--sql")
    assert (ran.code, ran.said) == (
        2,
        "mersal: mersal db upgrade needs --dialect postgresql|sqlite, or a database URL (only "
        "its dialect is used)",
    )


@pytest.mark.integration
@pytest.mark.parametrize("made_by", ["this release", "the release before"])
async def test_a_migrated_outbox_beside_an_unmigrated_inbox_is_fixed_by_the_command_suggested(
    empty_postgres_url: str, memory_url: str, mersal: Mersal, made_by: str
) -> None:
    db = empty_postgres_url
    if made_by == "this release":
        first = await mersal("db", "upgrade", "--database", db, "--outbox-table", "billing_outbox")
        assert first.code == 0
    else:
        await migrate_as_before(db, "billing_outbox_only")
    assert {"billing_outbox", "mersal_inbox"} <= await tables_in(db)

    names = {"outbox_table": "billing_outbox", "inbox_table": "billing_inbox"}
    message = await start_error(db, memory_url, **names)
    assert message == (
        "the table(s) billing_inbox, billing_inbox_sagas, billing_inbox_schema, "
        f"billing_inbox_dead_letters do not exist in database {db}: run "
        f"`mersal db upgrade --database '{db}' --outbox-table billing_outbox --inbox-table "
        "billing_inbox`"
    )
    [command] = suggested(message)
    assert (await mersal(*command)).code == 0
    assert await starts(db, memory_url, **names)
    assert "billing_outbox_billing_inbox_alembic_version" in await tables_in(db)
    if made_by == "the release before":  # the first pair is behind, at mersal_0001
        message = await start_error(db, memory_url, outbox_table="billing_outbox")
        assert message == (
            "the tables are at migration mersal_0001, behind mersal_0004 (the table(s) "
            "mersal_sagas, mersal_schema, mersal_dead_letters do not exist yet) in database "
            f"{db}: run `mersal db upgrade --database '{db}' --outbox-table billing_outbox`"
        )
        [command] = suggested(message)
        assert (await mersal(*command)).code == 0
    assert await starts(db, memory_url, outbox_table="billing_outbox")  # the first pair still


@pytest.mark.parametrize("alembic_project", [False, True])
async def test_tables_of_your_own_that_lack_a_column_are_not_recorded_at_the_head(
    tmp_path: Path, memory_url: str, mersal: Mersal, alembic_project: bool
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    tables = make_tables()
    engine = make_engine(db)
    async with engine.begin() as connection:
        await connection.run_sync(tables.metadata.create_all)
        await connection.execute(text("ALTER TABLE mersal_outbox DROP COLUMN parked_reason"))
        if alembic_project:  # a revision of the user's own, none of ours
            await connection.execute(text("CREATE TABLE alembic_version (version_num TEXT)"))
            await connection.execute(text("INSERT INTO alembic_version VALUES ('abc123')"))
    await engine.dispose()

    if alembic_project:
        remedy = (
            "apply revision mersal_0004 in your Alembic project: `alembic upgrade head` if it "
            "includes our versions (after `alembic merge heads` if it shows two heads), else a "
            "migration of your own that adds the columns"
        )
    else:
        remedy = (
            "add the columns (see mersal_sqlalchemy/migrations/versions), or record the "
            f"revision the tables are at with `mersal db stamp REVISION --database '{db}'` and "
            f"run `mersal db upgrade --database '{db}'`"
        )
    assert await start_error(db, memory_url) == (
        "table mersal_outbox has no column(s) parked_reason: it is out of date in database "
        f"{db}: {remedy}"
    )
    upgrade = await mersal("db", "upgrade", "--database", db)
    assert (upgrade.code, upgrade.said) == (
        2,
        f"mersal: mersal_outbox and mersal_inbox exist in {db} without a revision of ours, and "
        "mersal_outbox has no column(s) parked_reason: record the revision they are at with "
        f"`mersal db stamp REVISION --database '{db}'`, then run this again",
    )
    stamp = await mersal("db", "stamp", "--database", db)
    assert (stamp.code, stamp.said) == (
        2,
        "mersal: table mersal_outbox has no column(s) parked_reason, so it is not at "
        "mersal_0004: record the revision it is at",
    )


async def test_a_recorded_revision_whose_tables_were_dropped_is_repaired_as_suggested(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await execute(db, "DROP TABLE mersal_inbox")

    advice = (
        f"the table(s) mersal_inbox do not exist in database {db}: "
        "mersal_outbox_alembic_version records tables that are gone: run "
        f"`mersal db stamp base --database '{db}'`, then `mersal db upgrade --database '{db}'`"
    )
    assert await start_error(db, memory_url) == advice
    upgrade = await mersal("db", "upgrade", "--database", db)
    assert (upgrade.code, upgrade.said) == (2, f"mersal: the upgrade ran, but {advice}")
    for command in suggested(advice):
        assert (await mersal(*command)).code == 0
    assert await starts(db, memory_url)


async def rows_in(database: str, name: str) -> int:
    """How many rows the table `name` holds."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            return int(
                (await connection.execute(text(f"SELECT count(*) FROM {name}"))).scalar_one()
            )
    finally:
        await engine.dispose()


async def add_outbox_row(database: str, outbox: str) -> None:
    """Write one unsent message into `outbox`."""
    engine = make_engine(database)
    row = {"app": "orders", "address": "x", "publish": False, "headers": "{}", "body": b"0"}
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(make_tables(outbox).outbox).values(**row))
    finally:
        await engine.dispose()


def pair(inbox: str) -> list[str]:
    """The table options naming billing_outbox and `inbox`."""
    return ["--outbox-table", "billing_outbox", "--inbox-table", inbox]


async def test_downgrading_one_pair_leaves_the_outbox_another_pair_records(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    for inbox in ("billing_inbox", "shipping_inbox"):
        assert (await mersal("db", "upgrade", "--database", db, *pair(inbox))).code == 0
    await add_outbox_row(db, "billing_outbox")

    downgraded = await mersal("db", "downgrade", "base", "--database", db, *pair("shipping_inbox"))
    assert (downgraded.code, downgraded.out) == (
        0,
        "left billing_outbox: billing_outbox_billing_inbox_alembic_version records it for "
        "another pair of tables\n"
        f"the outbox, inbox and saga tables in {db} are at base (no revision recorded)\n",
    )
    assert {"billing_outbox", "billing_inbox", "billing_inbox_sagas"} <= await tables_in(db)
    assert not {"shipping_inbox", "shipping_inbox_sagas"} & await tables_in(db)
    assert await rows_in(db, "billing_outbox") == 1
    names = {"outbox_table": "billing_outbox", "inbox_table": "billing_inbox"}
    assert await starts(db, memory_url, **names)


async def test_an_outbox_holding_rows_is_dropped_only_with_force(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await add_outbox_row(db, "mersal_outbox")
    refused = await mersal("db", "downgrade", "base", "--database", db)
    assert (refused.code, refused.said) == (
        2,
        f"mersal: mersal_outbox in {db} holds 1 row(s), messages not sent yet (or parked): the "
        "downgrade would drop them; pass --force to drop them anyway",
    )
    assert await tables_in(db) >= OURS
    assert await rows_in(db, "mersal_outbox") == 1

    forced = await mersal("db", "downgrade", "base", "--force", "--database", db)
    assert (forced.code, forced.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are at base (no revision recorded)\n",
    )
    assert await tables_in(db) == {"mersal_outbox_alembic_version"}


async def test_tables_made_without_alembic_are_taken_over_by_upgrade(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    engine = make_engine(db)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(make_tables().metadata.create_all)
    finally:
        await engine.dispose()
    upgraded = await mersal("db", "upgrade", "--database", db)
    assert (upgraded.code, upgraded.out) == (
        0,
        "found mersal_outbox and mersal_inbox without a revision of ours (made by your own "
        "migration?): recorded them at mersal_0004 in mersal_outbox_alembic_version\n"
        f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n",
    )


CONCURRENT = """
import sys, time
import alembic.command, alembic.script, asyncpg, sqlalchemy.dialects.postgresql.asyncpg
import mersal_sqlalchemy.cli, mersal_sqlalchemy.migrating
from mersal.cli import main
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
raise SystemExit(main(sys.argv[2:]))
"""


async def upgrade_at_once(database: str, pairs: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run `mersal db upgrade` for each pair in a process of its own, all at the same instant."""
    start = str(time.time() + 4)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MERSAL_")}
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CONCURRENT,
            start,
            "db",
            "upgrade",
            "--database",
            database,
            *tables,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
        )
        for tables in pairs
    ]
    done = [await process.communicate() for process in processes]
    return [
        (int(process.returncode or 0), out.decode(), err.decode())
        for process, (out, err) in zip(processes, done, strict=True)
    ]


@pytest.mark.integration
@pytest.mark.parametrize("shared", [False, True], ids=["one pair", "pairs sharing the outbox"])
async def test_four_upgrades_at_once_on_a_fresh_database_all_succeed(
    empty_postgres_url: str, memory_url: str, shared: bool
) -> None:
    db = empty_postgres_url
    inboxes = [f"inbox_{n}" if shared else "billing_inbox" for n in range(4)]
    results = await upgrade_at_once(db, [pair(inbox) for inbox in inboxes])
    at_head = f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n"
    assert [(code, out.endswith(at_head)) for code, out, _ in results] == [(0, True)] * 4, results
    for inbox in set(inboxes):
        assert await starts(db, memory_url, outbox_table="billing_outbox", inbox_table=inbox)
        version = version_table_name("billing_outbox", inbox)
        assert await rows_in(db, version) == 1


@pytest.mark.integration
async def test_upgrade_without_create_rights_says_what_to_do(
    empty_postgres_url: str, mersal: Mersal
) -> None:
    role = f"mersal_test_{uuid4().hex[:12]}"
    await execute(empty_postgres_url, f"CREATE ROLE {role} LOGIN")
    try:
        db = make_url(empty_postgres_url).set(username=role).render_as_string(False)
        refused = await mersal("db", "upgrade", "--database", db)
    finally:
        await execute(empty_postgres_url, f"DROP ROLE {role}")
    assert (refused.code, refused.said) == (
        2,
        f"mersal: upgrade the tables in {db} failed: ProgrammingError: permission "
        "denied for schema public; grant CREATE on the schema to this user, or have a DBA "
        "apply `mersal db upgrade --sql`",
    )


# The saga table (mersal_0002): named after the inbox, created and dropped with its revision.


async def indexes_of(database: str, name: str) -> list[tuple[str, list[str], bool]]:
    """The indexes of table `name`: name, columns, unique."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            found = await connection.run_sync(lambda c: inspect(c).get_indexes(name))
    finally:
        await engine.dispose()
    return [(str(i["name"]), [str(c) for c in i["column_names"]], i["unique"]) for i in found]


async def add_dead_letter_row(database: str) -> None:
    """Store one failed message in the dead-letter table."""
    engine = make_engine(database)
    row = {
        "app": "orders",
        "key": "k" * 64,
        "error_queue": "error",
        "group_key": "g" * 64,
        "group_label": "ValueError: x",
        "headers": "{}",
        "body": b"{}",
    }
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(make_tables().dead_letters).values(**row))
    finally:
        await engine.dispose()


async def add_saga_row(database: str, inbox: str = "mersal_inbox") -> None:
    """Write the state of one running saga into the saga table of `inbox`."""
    engine = make_engine(database)
    row = {
        "app": "orders",
        "saga": "checkout",
        "correlation": "o-1",
        "id": str(uuid4()),
        "revision": 1,
        "data": "{}",
    }
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(make_tables(inbox=inbox).sagas).values(**row))
    finally:
        await engine.dispose()


async def test_upgrade_from_base_creates_the_saga_table_and_records_the_head(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    assert await tables_in(db) == {*OURS, "mersal_outbox_alembic_version"}
    assert await indexes_of(db, "mersal_sagas") == [("ix_mersal_sagas_id", ["id"], True)]
    assert await rows_in(db, "mersal_outbox_alembic_version") == 1
    current = await mersal("db", "current", "--database", db)
    assert current.out == "mersal_0004 (head), recorded in mersal_outbox_alembic_version\n"
    await add_saga_row(db)
    with pytest.raises(IntegrityError):  # the same saga of the same app, correlated alike
        await add_saga_row(db)


async def test_tables_at_the_first_revision_fail_the_start_until_upgraded(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    first = await mersal("db", "upgrade", "--revision", "mersal_0001", "--database", db)
    assert (first.code, first.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are at mersal_0001\n",
    )
    assert await tables_in(db) == {"mersal_outbox", "mersal_inbox", "mersal_outbox_alembic_version"}
    current = await mersal("db", "current", "--database", db)
    assert current.out == "mersal_0001, recorded in mersal_outbox_alembic_version\n"

    advice = (
        "the tables are at migration mersal_0001, behind mersal_0004 (the table(s) mersal_sagas, "
        f"mersal_schema, mersal_dead_letters do not exist yet) in database {db}: run `mersal db "
        f"upgrade --database '{db}'`"
    )
    assert await start_error(db, memory_url) == advice
    check = await mersal("db", "check", "--database", db)
    assert (check.code, check.said) == (1, f"mersal: {advice}")
    [command] = suggested(advice)
    upgraded = await mersal(*command)
    assert (upgraded.code, upgraded.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n",
    )
    assert "mersal_sagas" in await tables_in(db)
    assert await indexes_of(db, "mersal_sagas") == [("ix_mersal_sagas_id", ["id"], True)]
    assert await starts(db, memory_url)


async def test_downgrading_to_the_first_revision_drops_only_the_saga_table(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await add_outbox_row(db, "mersal_outbox")  # not in the way: the outbox stays

    downgraded = await mersal("db", "downgrade", "mersal_0001", "--database", db)
    assert (downgraded.code, downgraded.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are at mersal_0001\n",
    )
    assert await tables_in(db) == {"mersal_outbox", "mersal_inbox", "mersal_outbox_alembic_version"}
    assert await rows_in(db, "mersal_outbox") == 1
    assert "behind mersal_0004" in await start_error(db, memory_url)

    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    assert await starts(db, memory_url)
    assert await rows_in(db, "mersal_outbox") == 1


async def test_each_step_back_drops_only_the_table_of_its_revision(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await add_outbox_row(db, "mersal_outbox")  # no refusal: the outbox stays
    for revision, dropped in (
        ("mersal_0003", "mersal_dead_letters"),
        ("mersal_0002", "mersal_schema"),
        ("mersal_0001", "mersal_sagas"),
    ):
        before = await tables_in(db)
        back = await mersal("db", "downgrade", "-1", "--database", db)
        assert (back.code, back.out) == (
            0,
            f"the outbox, inbox and saga tables in {db} are at {revision}\n",
        ), back.err
        assert await tables_in(db) == before - {dropped}
    refused = await mersal("db", "downgrade", "-1", "--database", db)
    assert (refused.code, refused.said) == (
        2,
        f"mersal: mersal_outbox in {db} holds 1 row(s), messages not sent yet (or parked): the "
        "downgrade would drop them; pass --force to drop them anyway",
    )


async def test_a_saga_table_holding_rows_is_dropped_only_with_force(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await add_saga_row(db)
    for target in ("mersal_0001", "base"):
        refused = await mersal("db", "downgrade", target, "--database", db)
        assert (refused.code, refused.said) == (
            2,
            f"mersal: mersal_sagas in {db} holds 1 row(s), the state of sagas not finished yet: "
            "the downgrade would drop them; pass --force to drop them anyway",
        )
    assert "mersal_sagas" in await tables_in(db)

    forced = await mersal("db", "downgrade", "mersal_0001", "--force", "--database", db)
    assert (forced.code, forced.out) == (
        0,
        f"the outbox, inbox and saga tables in {db} are at mersal_0001\n",
    )
    assert "mersal_sagas" not in await tables_in(db)


async def test_a_dead_letter_table_holding_failures_is_dropped_only_with_force(
    empty_database: str, mersal: Mersal
) -> None:
    db = empty_database
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    await add_dead_letter_row(db)

    refused = await mersal("db", "downgrade", "mersal_0003", "--database", db)
    assert (refused.code, refused.said) == (
        2,
        f"mersal: mersal_dead_letters in {db} holds 1 row(s), failed messages not retried or "
        "deleted yet: the downgrade would drop them; pass --force to drop them anyway",
    )
    assert await rows_in(db, "mersal_dead_letters") == 1

    forced = await mersal("db", "downgrade", "mersal_0003", "--force", "--database", db)
    assert forced.code == 0, forced.err
    assert "mersal_dead_letters" not in await tables_in(db)


async def test_the_saga_table_of_other_table_names_is_named_after_the_inbox(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    upgraded = await mersal("db", "upgrade", "--database", db, *pair("billing_inbox"))
    assert upgraded.code == 0, upgraded.err
    assert await tables_in(db) == {
        "billing_outbox",
        "billing_inbox",
        "billing_inbox_sagas",
        "billing_inbox_schema",
        "billing_inbox_dead_letters",
        "billing_outbox_billing_inbox_alembic_version",
    }
    indexes = await indexes_of(db, "billing_inbox_sagas")
    assert indexes == [("ix_billing_inbox_sagas_id", ["id"], True)]
    names = {"outbox_table": "billing_outbox", "inbox_table": "billing_inbox"}
    async with orders_app(db, memory_url, Probe(), create_tables=False, **names) as app:
        assert storage_of(app).tables.sagas.name == "billing_inbox_sagas"

    down = await mersal("db", "downgrade", "mersal_0001", "--database", db, *pair("billing_inbox"))
    assert down.code == 0, down.err
    assert "billing_inbox_sagas" not in await tables_in(db)
    assert {"billing_outbox", "billing_inbox"} <= await tables_in(db)


async def test_pairs_sharing_an_inbox_share_its_saga_table_and_downgrades_leave_it(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    db = empty_database
    billing = ["--outbox-table", "billing_outbox", "--inbox-table", "shared_inbox"]
    shipping = ["--outbox-table", "shipping_outbox", "--inbox-table", "shared_inbox"]
    for tables in (billing, shipping):
        assert (await mersal("db", "upgrade", "--database", db, *tables)).code == 0

    down = await mersal("db", "downgrade", "mersal_0001", "--database", db, *billing)
    assert (down.code, down.out) == (
        0,
        "left shared_inbox_sagas: shipping_outbox_shared_inbox_alembic_version records it for "
        "another pair of tables\n"
        "left shared_inbox_schema: shipping_outbox_shared_inbox_alembic_version records it for "
        "another pair of tables\n"
        "left shared_inbox_dead_letters: shipping_outbox_shared_inbox_alembic_version records it "
        "for another pair of tables\n"
        f"the outbox, inbox and saga tables in {db} are at mersal_0001\n",
    )
    assert "shared_inbox_sagas" in await tables_in(db)

    down = await mersal("db", "downgrade", "base", "--database", db, *shipping)
    assert (down.code, down.out) == (
        0,
        "left shared_inbox: billing_outbox_shared_inbox_alembic_version records it for another "
        "pair of tables\n"
        f"the outbox, inbox and saga tables in {db} are at base (no revision recorded)\n",
    ), down.err  # the billing pair, at mersal_0001, has none of the inbox's later tables: they went
    gone = {
        "shipping_outbox",
        "shared_inbox_sagas",
        "shared_inbox_schema",
        "shared_inbox_dead_letters",
    }
    assert not gone & await tables_in(db)
    assert {"billing_outbox", "shared_inbox"} <= await tables_in(db)

    names = {"outbox_table": "billing_outbox", "inbox_table": "shared_inbox"}
    [command] = suggested(await start_error(db, memory_url, **names))
    assert (await mersal(*command)).code == 0
    assert await starts(db, memory_url, **names)


YOURS = "CREATE TABLE {name} (revision VARCHAR(32), compatible_with VARCHAR(32), note TEXT)"
"""A table of one's own, with the schema table's columns and one more."""

SAGA_COLUMNS = "app, saga, correlation, id, revision, data, created_at, updated_at"
NAMED_AFTER_THE_INBOX = [
    ("schema", "orders_schema", "revision, compatible_with", "mersal_0002"),
    ("saga", "orders_sagas", SAGA_COLUMNS, "mersal_0001"),
    (
        "dead-letter",
        "orders_dead_letters",
        ", ".join(column.name for column in make_tables().dead_letters.columns),
        "mersal_0003",
    ),
]


@pytest.mark.parametrize(
    ("what", "name", "ours", "before"),
    NAMED_AFTER_THE_INBOX,
    ids=["schema", "sagas", "dead-letters"],
)
async def test_a_table_of_your_own_named_after_the_inbox_fails_the_upgrade_and_is_kept(
    empty_database: str, mersal: Mersal, what: str, name: str, ours: str, before: str
) -> None:
    db = empty_database
    await execute(db, YOURS.format(name=name), f"INSERT INTO {name} VALUES ('v1', 'x', 'yours')")
    orders = ["--outbox-table", "orders_outbox", "--inbox-table", "orders"]

    refused = await mersal("db", "upgrade", "--database", db, *orders)
    assert (refused.code, refused.said) == (
        2,
        f"mersal: the table {name} in {db} is not Mersal's {what} table: it has the column(s) "
        f"revision, compatible_with, note, where Mersal's has {ours}; Mersal names its {what} "
        "table after the inbox orders: rename your table, or give Mersal's tables another "
        "inbox (--inbox-table here, inbox_table= in the app)",
    )
    assert await rows_in(db, name) == 1

    await execute(db, f"ALTER TABLE {name} RENAME TO kept")
    assert (await mersal("db", "upgrade", "--database", db, *orders)).code == 0
    await execute(db, f"DROP TABLE {name}", f"ALTER TABLE kept RENAME TO {name}")
    down = await mersal("db", "downgrade", before, "--database", db, *orders)
    assert (down.code, down.out) == (
        0,
        f"left {name}: it is not Mersal's {what} table (it has the column(s) revision, "
        "compatible_with, note)\n"
        f"the outbox, inbox and saga tables in {db} are at {before}\n",
    ), down.err
    assert await rows_in(db, name) == 1


async def test_the_start_brings_tables_at_the_first_revision_to_the_head_when_creating(
    empty_database: str, memory_url: str, mersal: Mersal
) -> None:
    """On SQLite by default (create_tables=None); elsewhere with create_tables=True."""
    db = empty_database
    first = await mersal("db", "upgrade", "--revision", "mersal_0001", "--database", db)
    assert first.code == 0, first.err
    await add_outbox_row(db, "mersal_outbox")
    creating = {} if db.startswith("sqlite") else {"create_tables": True}
    async with orders_app(db, memory_url, Probe(), **creating) as app:
        assert app.running
    assert await tables_in(db) == {*OURS, "mersal_outbox_alembic_version"}
    assert await indexes_of(db, "mersal_sagas") == [("ix_mersal_sagas_id", ["id"], True)]
    assert await rows_in(db, "mersal_outbox") == 1
    current = await mersal("db", "current", "--database", db)
    assert current.out == "mersal_0004 (head), recorded in mersal_outbox_alembic_version\n"
    down = await mersal("db", "downgrade", "mersal_0001", "--database", db)
    assert down.code == 0, down.err  # what the start made, the revision undoes
    assert "mersal_sagas" not in await tables_in(db)


async def test_the_start_does_not_create_the_saga_table_beside_an_outbox_lacking_a_column(
    tmp_path: Path, memory_url: str, mersal: Mersal
) -> None:
    db = sqlite_file(tmp_path)
    assert (await mersal("db", "upgrade", "--revision", "mersal_0001", "--database", db)).code == 0
    await execute(db, "ALTER TABLE mersal_outbox DROP COLUMN parked_reason")
    app = orders_app(db, memory_url, Probe())  # create_tables: SQLite's default
    with pytest.raises(ConfigurationError, match=r"has no column\(s\) parked_reason"):
        await app.start()
    assert "mersal_sagas" not in await tables_in(db)


@pytest.mark.parametrize("alembic_project", [False, True])
async def test_tables_of_your_own_without_the_saga_table_are_upgraded_from_the_first_revision(
    tmp_path: Path, memory_url: str, mersal: Mersal, alembic_project: bool
) -> None:
    db = sqlite_file(tmp_path)
    tables = make_tables()
    engine = make_engine(db)
    async with engine.begin() as connection:  # as an earlier release's make_tables made them
        await connection.run_sync(tables.metadata.create_all, tables=[tables.outbox, tables.inbox])
        if alembic_project:
            await connection.execute(text("CREATE TABLE alembic_version (version_num TEXT)"))
            await connection.execute(text("INSERT INTO alembic_version VALUES ('abc123')"))
    await engine.dispose()

    check = await mersal("db", "check", "--database", db)
    upgrade = await mersal("db", "upgrade", "--database", db)
    if alembic_project:
        assert check.said == (
            "mersal: the table(s) mersal_sagas, mersal_schema, mersal_dead_letters do not exist "
            f"in database {db}: apply revision mersal_0004 in your Alembic project: `alembic "
            "upgrade head` if it includes our versions (after `alembic merge heads` if it shows "
            "two heads), else a migration of your own that adds the table(s)"
        )
        assert (upgrade.code, upgrade.said) == (
            2,
            f"mersal: mersal_outbox and mersal_inbox exist in {db} without a revision of ours, "
            "beside your Alembic project's alembic_version: if your own Alembic project manages "
            "these tables, keep using `alembic upgrade head` there; if you want `mersal db` to "
            f"manage them, run `mersal db stamp mersal_0001 --database '{db}'` once, then "
            f"`mersal db upgrade --database '{db}'`",
        )
        head = await mersal("db", "stamp", "head", "--database", db)
        assert (head.code, head.said) == (
            2,
            "mersal: the table(s) mersal_sagas, mersal_schema, mersal_dead_letters do not exist "
            f"in {db}, so the tables are not at mersal_0004: record the revision they are at "
            f"with `mersal db stamp mersal_0001 --database '{db}'`, then run `mersal db upgrade "
            f"--database '{db}'`",
        )
        for command in suggested(head.said):
            ran = await mersal(*command)
            assert ran.code == 0, ran.err
        assert ran.out == f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n"
    else:
        assert check.said == (
            "mersal: the table(s) mersal_sagas, mersal_schema, mersal_dead_letters do not exist "
            f"in database {db}: run `mersal db upgrade --database '{db}'`"
        )
        assert (upgrade.code, upgrade.out) == (
            0,
            "found mersal_outbox and mersal_inbox without a revision of ours (made by your own "
            "migration?): recorded them at mersal_0001 in mersal_outbox_alembic_version\n"
            f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n",
        )
    assert "mersal_sagas" in await tables_in(db)
    assert await starts(db, memory_url)


async def test_an_inbox_named_mersal_shares_mersal_sagas_with_the_default_inbox(
    tmp_path: Path, mersal: Mersal
) -> None:
    db = sqlite_file(tmp_path)
    other = ["--outbox-table", "other_outbox", "--inbox-table", "mersal"]
    assert (await mersal("db", "upgrade", "--database", db)).code == 0
    assert (await mersal("db", "upgrade", "--database", db, *other)).code == 0
    down = await mersal("db", "downgrade", "base", "--database", db, *other)
    assert down.out.startswith(
        "left mersal_sagas: mersal_outbox_alembic_version records it for another pair of tables\n"
    ), down.err
    assert await tables_in(db) >= OURS
