"""Mersal's tables in a user's own Alembic project, run as a user runs it (`python -m alembic`).

Two routes: our versions directory in the project's `version_locations` (our branch, merged
once), or the tables on the project's metadata (the user owns the migration). In both,
`alembic upgrade head` works, `alembic check` finds nothing to change, the app starts, and the
`mersal db` commands cope with what they find. The project's env.py is the one docs/outbox.md
shows.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import alembic
import pytest
from alembic.util import coerce_resource_to_filename
from sqlalchemy import inspect

from mersal import ConfigurationError
from mersal_sqlalchemy import make_engine
from mersal_sqlalchemy.migrations import VERSIONS, VERSIONS_RESOURCE
from tests.mersal_sqlalchemy.support import Probe, Ran, orders_app, run_process
from tests.support import mersal

HERE = Path(__file__).parent
ENV = HERE / "alembic_project" / "env.py"
DOCS = HERE.parents[1] / "docs" / "outbox.md"
MIGRATIONS_PAGE = HERE.parents[1] / "docs" / "setup" / "migrations.md"
ENV_SAMPLE = HERE.parents[1] / "docs" / "samples" / "alembic_env.py"
TEMPLATE = Path(alembic.__file__).parent / "templates" / "async" / "script.py.mako"
NO_CHANGES = "No new upgrade operations detected."
OURS = {"mersal_outbox", "mersal_inbox", "mersal_sagas", "mersal_schema", "mersal_dead_letters"}

CUSTOMERS = '''"""Customers."""

import sqlalchemy as sa
from alembic import op

revision = "u0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "customers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("customers")
'''

MODELS = '''"""The project's models."""

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal_sqlalchemy import make_tables


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
'''

EARLIER_MERGE = '''"""include mersal"""

revision = "m0001"
down_revision = ("u0001", "mersal_0001")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
'''

OWN_TABLES = 'make_tables("{outbox}", "{inbox}", metadata=Base.metadata)\n'

SEPARATOR = "path_separator = space"
OUR_BRANCH = "version_locations = %(here)s/alembic/versions mersal_sqlalchemy.migrations:versions"
"""Our versions by package name, as the docs show it: no path to site-packages."""


@dataclass(frozen=True)
class Project:
    """A user's Alembic project in a directory: alembic.ini, alembic/, myapp/models.py."""

    root: Path

    @property
    def versions(self) -> Path:
        """The project's own versions directory."""
        return self.root / "alembic" / "versions"

    async def alembic(self, *arguments: str) -> Ran:
        """Run `python -m alembic ARGUMENTS` in the project, as its user would."""
        return await run_process([sys.executable, "-m", "alembic", *arguments], self.root)

    def own_tables(self, outbox: str = "mersal_outbox", inbox: str = "mersal_inbox") -> None:
        """Put our tables on the project's metadata, as `make_tables(metadata=...)` does."""
        models = self.root / "myapp" / "models.py"
        line = OWN_TABLES.format(outbox=outbox, inbox=inbox)
        models.write_text(models.read_text() + "\n" + line)


def write_project(
    root: Path, database: str, *, our_branch: bool, options: dict[str, str] | None = None
) -> Project:
    """A project with a customers table and its migration; our versions added if `our_branch`."""
    (root / "alembic" / "versions").mkdir(parents=True)
    (root / "myapp").mkdir()
    (root / "myapp" / "__init__.py").write_text("")
    (root / "myapp" / "models.py").write_text(MODELS)
    (root / "alembic" / "env.py").write_text(ENV.read_text())
    (root / "alembic" / "script.py.mako").write_text(TEMPLATE.read_text())
    (root / "alembic" / "versions" / "u0001_customers.py").write_text(CUSTOMERS)
    lines = [
        "[alembic]",
        "script_location = %(here)s/alembic",
        "prepend_sys_path = .",
        SEPARATOR,
        f"sqlalchemy.url = {database}",
    ]
    if our_branch:
        lines.append(OUR_BRANCH)
    lines += [f"{name} = {value}" for name, value in (options or {}).items()]
    (root / "alembic.ini").write_text("\n".join(lines) + "\n")
    return Project(root)


async def table_names(database: str) -> set[str]:
    """The tables in `database`."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def app_starts(database: str, memory_url: str, **options: str) -> bool:
    """Whether the orders app starts on `database` (its start checks the tables)."""
    async with orders_app(database, memory_url, Probe(), create_tables=False, **options) as app:
        return app.running


def test_the_docs_add_our_versions_by_package_name_as_tested() -> None:
    for page in (DOCS, MIGRATIONS_PAGE):
        text = page.read_text()
        assert SEPARATOR in text and OUR_BRANCH in text, page
        assert "site-packages/mersal_sqlalchemy" not in text, page
    assert coerce_resource_to_filename(VERSIONS_RESOURCE) == VERSIONS
    assert OUR_BRANCH.endswith(f" {VERSIONS_RESOURCE}")


def test_the_migrations_page_shows_include_object_before_anything_else() -> None:
    text = MIGRATIONS_PAGE.read_text()
    first_block = text.index("```")
    copied = "<!-- copied from docs/samples/alembic_env.py:configure by make docs-samples -->\n"
    assert text.index(copied) + len(copied) == first_block
    assert first_block < text.index("version_locations")
    assert first_block < text.index("make_tables")
    assert "include_object=include_object" in ENV_SAMPLE.read_text()  # tested in tests/docs


def test_the_env_py_in_the_docs_is_the_one_tested() -> None:
    pattern = r"```python\n(\"\"\"Your Alembic project's env\.py.*?)```"
    shown = re.search(pattern, DOCS.read_text(), re.DOTALL)
    assert shown is not None, "docs/outbox.md shows the env.py"
    assert shown.group(1) == ENV.read_text()


async def test_our_branch_in_your_project_upgrades_to_head_after_one_merge(
    empty_database: str, tmp_path: Path, memory_url: str
) -> None:
    project = write_project(tmp_path / "project", empty_database, our_branch=True)
    heads = await project.alembic("heads")
    assert sorted(heads.out.splitlines()) == ["mersal_0004 (mersal) (head)", "u0001 (head)"]
    refused = await project.alembic("upgrade", "head")
    assert refused.code != 0
    assert refused.out.startswith(
        "FAILED: Multiple head revisions are present for given argument 'head'"
    )

    ours = sorted(VERSIONS.iterdir())
    merged = await project.alembic("merge", "-m", "include mersal", "heads")
    assert merged.code == 0, merged.err
    assert sorted(VERSIONS.iterdir()) == ours  # the merge lands in the project, not in ours
    [merge] = project.versions.glob("*_include_mersal.py")
    assert (await project.alembic("heads")).out == f"{merge.name.split('_')[0]} (mersal) (head)\n"

    upgraded = await project.alembic("upgrade", "head")
    assert upgraded.code == 0, upgraded.err
    assert await table_names(empty_database) == {
        "alembic_version",
        "customers",
        "mersal_inbox",
        "mersal_outbox",
        "mersal_sagas",
        "mersal_schema",
        "mersal_dead_letters",
    }
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)


async def test_without_a_merge_upgrade_heads_works_and_check_finds_nothing(
    empty_database: str, tmp_path: Path, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    project = write_project(tmp_path / "project", empty_database, our_branch=True)
    upgraded = await project.alembic("upgrade", "heads")
    assert upgraded.code == 0, upgraded.err
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)

    assert await mersal("db", "current", "--database", empty_database) == 0
    assert capsys.readouterr().out == (
        "mersal_0004 (head), recorded in alembic_version (your Alembic project's)\n"
    )
    for action in ("upgrade", "downgrade"):
        arguments = ["base"] if action == "downgrade" else []
        assert await mersal("db", action, *arguments, "--database", empty_database) == 2
        assert capsys.readouterr().err == (
            f"mersal: the tables in {empty_database} are migrated by your own Alembic project "
            f"(mersal_0004 in alembic_version): {action} them there (`alembic {action} ...`), "
            f"or take them over with `mersal db stamp mersal_0004 --database '{empty_database}'` "
            "first\n"
        )
    assert await table_names(empty_database) >= OURS


@pytest.mark.integration
async def test_our_branch_takes_the_table_names_from_alembic_ini(
    empty_postgres_url: str, tmp_path: Path, memory_url: str
) -> None:
    names = {"mersal_outbox_table": "orders_outbox", "mersal_inbox_table": "orders_inbox"}
    project = write_project(
        tmp_path / "project", empty_postgres_url, our_branch=True, options=names
    )
    assert (await project.alembic("merge", "-m", "include mersal", "heads")).code == 0
    upgraded = await project.alembic("upgrade", "head")
    assert upgraded.code == 0, upgraded.err
    tables = await table_names(empty_postgres_url)
    assert {
        "orders_outbox",
        "orders_inbox",
        "orders_inbox_sagas",
        "orders_inbox_schema",
        "orders_inbox_dead_letters",
    } <= tables
    assert not OURS & tables
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    options = {"outbox_table": "orders_outbox", "inbox_table": "orders_inbox"}
    assert await app_starts(empty_postgres_url, memory_url, **options)


async def test_tables_you_own_are_refused_by_upgrade_and_recorded_by_stamp(
    empty_database: str,
    tmp_path: Path,
    memory_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    project = write_project(tmp_path / "project", empty_database, our_branch=False)
    assert (await project.alembic("upgrade", "head")).code == 0
    project.own_tables()
    generated = await project.alembic("revision", "--autogenerate", "-m", "mersal tables")
    assert generated.code == 0, generated.err
    [revision] = project.versions.glob("*_mersal_tables.py")
    written = revision.read_text()
    assert "op.create_table('mersal_outbox'" in written
    assert "op.create_table('mersal_inbox'" in written
    assert "op.create_table('mersal_sagas'" in written
    assert "op.create_table('mersal_dead_letters'" in written
    assert (await project.alembic("upgrade", "head")).code == 0
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)

    capsys.readouterr()
    assert await mersal("db", "upgrade", "--database", empty_database) == 2
    assert capsys.readouterr().err == refused_take_over(empty_database)
    assert "mersal_outbox_alembic_version" not in await table_names(empty_database)

    assert await mersal("db", "stamp", "head", "--database", empty_database) == 0
    at_head = f"the outbox, inbox and saga tables in {empty_database} are at mersal_0004 (head)\n"
    assert capsys.readouterr().out == at_head
    assert await mersal("db", "upgrade", "--database", empty_database) == 0
    assert capsys.readouterr().out == at_head
    assert "mersal_outbox_alembic_version" in await table_names(empty_database)
    checked = await project.alembic("check")  # include_object hides our version table
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)


def refused_take_over(database: str) -> str:
    """What `mersal db upgrade` says of our tables beside a project's alembic_version."""
    return (
        f"mersal: mersal_outbox and mersal_inbox exist in {database} without a revision of "
        "ours, beside your Alembic project's alembic_version: if your own Alembic project "
        "manages these tables, keep using `alembic upgrade head` there; if you want `mersal db` "
        f"to manage them, run `mersal db stamp head --database '{database}'` once\n"
    )


async def test_after_the_merge_mersal_db_leaves_the_tables_to_your_project(
    empty_database: str, tmp_path: Path, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    project = write_project(tmp_path / "project", empty_database, our_branch=True)
    assert (await project.alembic("merge", "-m", "include mersal", "heads")).code == 0
    upgraded = await project.alembic("upgrade", "head")
    assert upgraded.code == 0, upgraded.err
    tables = await table_names(empty_database)

    capsys.readouterr()
    assert await mersal("db", "upgrade", "--database", empty_database) == 2
    assert capsys.readouterr().err == refused_take_over(empty_database)
    assert await mersal("db", "downgrade", "base", "--database", empty_database) == 2
    assert capsys.readouterr().err == (
        "mersal: no revision of ours is recorded for mersal_outbox and mersal_inbox in "
        f"{empty_database}: there is nothing to downgrade (tables your own migrations made "
        "are yours)\n"
    )
    assert await table_names(empty_database) == tables
    assert "mersal_outbox_alembic_version" not in tables
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)


async def start_error(database: str, memory_url: str) -> str:
    """The ConfigurationError the orders app fails to start with."""
    app = orders_app(database, memory_url, Probe(), create_tables=False)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    return str(raised.value)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "not merged"])
async def test_our_next_revision_reaches_your_project_through_alembic(
    empty_database: str, tmp_path: Path, memory_url: str, merged: bool
) -> None:
    """As a project that included our branch when mersal_0001 was its head upgrades."""
    project = write_project(tmp_path / "project", empty_database, our_branch=True)
    if merged:  # what `alembic merge heads` wrote then (it merges only heads)
        (project.versions / "m0001_include_mersal.py").write_text(EARLIER_MERGE)
        upgraded = await project.alembic("upgrade", "m0001")
    else:
        assert (await project.alembic("upgrade", "u0001")).code == 0
        upgraded = await project.alembic("upgrade", "mersal_0001")
    assert upgraded.code == 0, upgraded.err
    assert "mersal_sagas" not in await table_names(empty_database)

    if merged:
        assert await start_error(empty_database, memory_url) == (
            "the table(s) mersal_sagas, mersal_schema, mersal_dead_letters do not exist in "
            f"database {empty_database}: apply revision mersal_0004 in your Alembic project: "
            "`alembic upgrade head` if it includes our versions (after `alembic merge heads` if it "
            "shows two heads), else a migration of your own that adds the table(s)"
        )
        heads = await project.alembic("heads")
        assert len(heads.out.splitlines()) == 2
        assert (await project.alembic("merge", "-m", "mersal 0002", "heads")).code == 0
        upgraded = await project.alembic("upgrade", "head")
    else:
        assert await start_error(empty_database, memory_url) == (
            "the tables are at migration mersal_0001, behind mersal_0004 (the table(s) "
            "mersal_sagas, mersal_schema, mersal_dead_letters do not exist yet) in database "
            f"{empty_database}: they are migrated by your own Alembic project: run `alembic "
            "upgrade heads` there (after `alembic merge heads`, `alembic upgrade head` does it too)"
        )
        upgraded = await project.alembic("upgrade", "heads")
    assert upgraded.code == 0, upgraded.err
    assert await table_names(empty_database) >= OURS
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)


async def test_after_mersal_db_downgrade_base_your_project_takes_the_tables_over(
    empty_database: str, tmp_path: Path, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """From `mersal db` to our branch in your project: the empty version table is no dead end."""
    assert await mersal("db", "upgrade", "--database", empty_database) == 0
    assert await mersal("db", "downgrade", "base", "--database", empty_database) == 0
    assert await table_names(empty_database) == {"mersal_outbox_alembic_version"}

    project = write_project(tmp_path / "project", empty_database, our_branch=True)
    assert (await project.alembic("merge", "-m", "include mersal", "heads")).code == 0
    upgraded = await project.alembic("upgrade", "head")
    assert upgraded.code == 0, upgraded.err
    assert await table_names(empty_database) >= OURS
    checked = await project.alembic("check")
    assert (checked.code, checked.out.strip()) == (0, NO_CHANGES), checked.err
    assert await app_starts(empty_database, memory_url)
    capsys.readouterr()
    assert await mersal("db", "check", "--database", empty_database) == 0
    assert capsys.readouterr().out == (
        f"the outbox, inbox and saga tables in {empty_database} are up to date\n"
    )
    assert await mersal("db", "upgrade", "--database", empty_database) == 2
    assert capsys.readouterr().err == refused_take_over(empty_database)


async def test_an_empty_version_table_without_the_tables_is_a_fresh_database(
    empty_database: str, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await mersal("db", "upgrade", "--database", empty_database) == 0
    assert await mersal("db", "downgrade", "base", "--database", empty_database) == 0
    capsys.readouterr()
    assert await mersal("db", "check", "--database", empty_database) == 1
    assert capsys.readouterr().err == (
        "mersal: the table(s) mersal_outbox, mersal_inbox, mersal_sagas, mersal_schema, "
        f"mersal_dead_letters do not exist in database {empty_database}: run `mersal db upgrade "
        f"--database '{empty_database}'`\n"
    )
    async with orders_app(empty_database, memory_url, Probe(), create_tables=True) as app:
        assert app.running  # created them, as on a fresh database
    assert await mersal("db", "current", "--database", empty_database) == 0
    assert capsys.readouterr().out == (
        "mersal_0004 (head), recorded in mersal_outbox_alembic_version\n"
    )
    assert await mersal("db", "downgrade", "base", "--database", empty_database) == 0
    assert await mersal("db", "upgrade", "--database", empty_database) == 0
    assert await app_starts(empty_database, memory_url)
