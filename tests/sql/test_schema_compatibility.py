"""Two releases on one database: the schema table says which releases can run on a revision.

The newer release is a copy of this package tree with one more revision, `mersal_0004`, run
with `mersal db` in a process of its own; this release (the code under test) then starts on
the database it migrated, or refuses it, saying what it needs.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mersal import ConfigurationError
from mersal.cli import main
from mersal_sqlalchemy import HEAD_REVISION, make_engine
from tests.sql.support import (
    ORDERS,
    PlaceOrder,
    Probe,
    Ran,
    count,
    create_business_tables,
    execute,
    orders_app,
    run_process,
)
from tests.support import eventually

ROOT = Path(__file__).parents[2]
PACKAGES = ("mersal", "mersal_sqlalchemy")

NEXT_REVISION = '''"""An audit table.

Revision ID: mersal_0004
Revises: mersal_0003
Create Date: 2026-06-01 00:00:00
"""

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import record_compatibility, table_names

revision = "mersal_0004"
down_revision = "mersal_0003"
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
    'HEAD_REVISION = "mersal_0003"': 'HEAD_REVISION = "mersal_0004"',
    'REVISIONS = ("mersal_0001", "mersal_0002", HEAD_REVISION)': (
        'REVISIONS = ("mersal_0001", "mersal_0002", "mersal_0003", HEAD_REVISION)'
    ),
    '    "mersal_0003": "mersal_0001",\n}': (
        '    "mersal_0003": "mersal_0001",\n    "mersal_0004": "{compatible_with}",\n}'
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
    """This package tree with `mersal_0004`, on which code of `compatible_with` or later runs."""
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
    (versions / "0004_audit.py").write_text(NEXT_REVISION.format(compatible_with=compatible_with))
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
    newer = next_release(tmp_path / "next", compatible_with="mersal_0003")
    upgraded = await newer.mersal("db", "upgrade", "--database", db)
    assert upgraded.code == 0, upgraded.err
    assert upgraded.out == f"the outbox, inbox and saga tables in {db} are at mersal_0004 (head)\n"
    await create_business_tables(db)

    caplog.set_level(logging.INFO, logger="mersal.sqlalchemy")
    assert await handles_a_message(db, memory_url)
    newer_and_compatible = (
        f"the tables in {db} are at migration mersal_0004 (in mersal_outbox_alembic_version), "
        f"newer than this version of mersal_sqlalchemy ({HEAD_REVISION}) and compatible with "
        "it: mersal_0004 runs code of mersal_0003 or later"
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
        "mersal_0004, recorded in mersal_outbox_alembic_version (newer than this release's "
        "mersal_0003; code of mersal_0003 or later runs on it)\n"
    )
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db]) == 0
    assert capsys.readouterr().out == newer_and_compatible + ": nothing to upgrade\n"

    back = await newer.mersal("db", "downgrade", "mersal_0003", "--database", db)
    assert back.code == 0, back.err  # no --force: the revision only added a table
    assert back.out == f"the outbox, inbox and saga tables in {db} are at mersal_0003\n"
    assert await asyncio.to_thread(main, ["db", "check", "--database", db]) == 0


async def test_a_revision_that_breaks_older_code_is_refused_with_what_it_needs(
    empty_database: str, tmp_path: Path, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = empty_database
    newer = next_release(tmp_path / "next", compatible_with="mersal_0004")
    upgraded = await newer.mersal("db", "upgrade", "--database", db)
    assert upgraded.code == 0, upgraded.err
    await create_business_tables(db)

    refused = (
        "the tables are at migration mersal_0004 (in mersal_outbox_alembic_version), on which "
        "only code of mersal_0004 or later runs: this version of mersal_sqlalchemy is at "
        f"mersal_0003 in database {db}: install a newer release of mersal-bus[sqlalchemy], one "
        "that knows mersal_0004; or, to run this one, undo the migration with the release that "
        f"made it: `mersal db downgrade mersal_0003 --database '{db}'`"
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
        "mersal_0004, recorded in mersal_outbox_alembic_version (newer than this release's "
        "mersal_0003; it needs code of mersal_0004 or later)\n"
    )
    assert await asyncio.to_thread(main, ["db", "upgrade", "--database", db]) == 2
    assert capsys.readouterr().err == f"mersal: {refused}\n"

    command = shlex.split(refused.rsplit("`", 2)[1])[1:]  # what the message says to run, there
    back = await newer.mersal(*command)
    assert back.code == 0, back.err
    assert await handles_a_message(db, memory_url)


AT_NEXT = "UPDATE mersal_outbox_alembic_version SET version_num = 'mersal_0004'"
"""What a newer release's upgrade records, without its revision (the tables stay as they are)."""

WITH_THE_NEWER_RELEASE = (
    "with the release of mersal-bus[sqlalchemy] that migrated them (it knows mersal_0004), run "
)

BROKEN_SCHEMA_TABLES = {
    "renamed column": (
        ["ALTER TABLE mersal_schema RENAME COLUMN compatible_with TO cw"],
        "table mersal_schema has no column(s) compatible_with: it is out of date in database "
        "{db}: " + WITH_THE_NEWER_RELEASE + "`mersal db upgrade --database '{db}'`",
        ", or unknown to it; no compatibility recorded)",
    ),
    "not a revision": (
        ["INSERT INTO mersal_schema VALUES ('mersal_0004', 'garbage')"],
        "the tables are at migration mersal_0004 (in mersal_outbox_alembic_version), and the "
        "row of mersal_0004 in mersal_schema records compatible_with 'garbage', which is not a "
        "Mersal revision: this version of mersal_sqlalchemy cannot tell whether it runs on them "
        "in database {db}: set that row's compatible_with to the one in the revision file of "
        "mersal_0004, in the release of mersal-bus[sqlalchemy] that made it; or run that release",
        "; the compatible_with recorded for mersal_0004 in mersal_schema, 'garbage', is not a "
        "Mersal revision)",
    ),
    "missing": (
        ["DROP TABLE mersal_schema"],
        "the table(s) mersal_schema do not exist (without the schema table, this version of "
        "mersal_sqlalchemy cannot tell whether it runs on mersal_0004) in database {db}: "
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
        "mersal_0004, recorded in mersal_outbox_alembic_version (newer than this release's "
        f"mersal_0003{compatibility}\n"
    )
