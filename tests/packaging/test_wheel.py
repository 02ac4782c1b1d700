"""The sdist and wheel `make dist` builds: named mersal-bus, complete, and working once installed.

The wheel is built from the sdist (as `python -m build` does), installed without its
dependencies into a fresh venv, and given the ones the core, `rabbitmq` and `sqlalchemy` need
from this environment through a `.pth`: no index is asked, and the checkout is not on the path.
"""

from __future__ import annotations

import configparser
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Iterator
from email.message import Message
from email.parser import HeaderParser
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, HEAD_REVISION, made_by

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
PACKAGES = {"mersal", "mersal_amqp10", "mersal_dashboard", "mersal_rabbitmq", "mersal_sqlalchemy"}
EXTRAS = ("rabbitmq", "sqlalchemy")
"""The extras the installed wheel is tried with."""


def run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `command` in `cwd`; fail the test, with its output, if it fails."""
    ran = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ran.returncode == 0, f"{command}: exit {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    return ran


def once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder `make` filled once for the whole run, whichever pytest-xdist worker came first."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (root / f"{name}.done").touch()
    return folder


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ as `make dist` leaves it: the sdist and the wheel built from it."""
    pytest.importorskip("build", reason="`make dist` builds with `build` (the dev extra)")
    return once(
        tmp_path_factory,
        "dist",
        lambda out: run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out),
    )


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Iterator[zipfile.ZipFile]:
    """The wheel, open."""
    with zipfile.ZipFile(dist / f"mersal_bus-{VERSION}-py3-none-any.whl") as opened:
        yield opened


def metadata(wheel: zipfile.ZipFile) -> Message:
    """The wheel's METADATA."""
    text = wheel.read(f"mersal_bus-{VERSION}.dist-info/METADATA").decode()
    return HeaderParser().parsestr(text)


def test_make_dist_builds_the_sdist_and_the_wheel_of_mersal_bus(dist: Path) -> None:
    assert sorted(path.name for path in dist.iterdir()) == [
        f"mersal_bus-{VERSION}-py3-none-any.whl",
        f"mersal_bus-{VERSION}.tar.gz",
    ]


def test_the_wheel_is_mersal_bus_with_every_extra_of_pyproject(wheel: zipfile.ZipFile) -> None:
    found = metadata(wheel)
    assert (found["Name"], found["Version"]) == ("mersal-bus", VERSION)
    assert found.get_all("Provides-Extra") == list(PROJECT["optional-dependencies"])
    requires = found.get_all("Requires-Dist")
    assert [line for line in requires if "extra ==" not in line] == PROJECT["dependencies"]
    assert 'mersal-bus[health,otel]; extra == "prometheus"' in requires
    assert not [line for line in requires if Requirement(line).name == "mersal"]


def test_the_wheel_carries_the_packages_py_typed_and_the_migrations(
    wheel: zipfile.ZipFile,
) -> None:
    names = set(wheel.namelist())
    top = {name.split("/")[0] for name in names} - {f"mersal_bus-{VERSION}.dist-info"}
    assert top == PACKAGES
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    migrations = ROOT / "mersal_sqlalchemy" / "migrations"
    shipped = {
        path.relative_to(ROOT).as_posix()
        for path in migrations.rglob("*")
        if path.suffix in (".py", ".mako")
    }
    assert "mersal_sqlalchemy/migrations/env.py" in shipped
    assert shipped <= names
    dashboard = ROOT / "mersal_dashboard"
    pages = {p.relative_to(ROOT).as_posix() for p in dashboard.glob("*/*") if p.suffix != ".pyc"}
    assert "mersal_dashboard/templates/base.html" in pages
    assert pages <= names


def test_the_wheel_declares_the_command_and_the_adapters_entry_points(
    wheel: zipfile.ZipFile,
) -> None:
    declared = configparser.ConfigParser(delimiters=("=",))
    declared.read_string(wheel.read(f"mersal_bus-{VERSION}.dist-info/entry_points.txt").decode())
    found = {group: dict(declared[group]) for group in declared.sections()}
    assert found == {"console_scripts": PROJECT["scripts"], **PROJECT["entry-points"]}


@pytest.fixture(scope="module")
def venv(dist: Path, wheel: zipfile.ZipFile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed and the dependencies of its extras linked in."""
    requires = [Requirement(line) for line in metadata(wheel).get_all("Requires-Dist")]
    wheel_path = dist / f"mersal_bus-{VERSION}-py3-none-any.whl"
    return once(tmp_path_factory, "venv", lambda home: make_venv(home, wheel_path, requires))


def make_venv(home: Path, wheel: Path, requires: list[Requirement]) -> None:
    """In `home`: a venv with `wheel` installed and what `requires` needs linked into it."""
    run(sys.executable, "-m", "venv", "--without-pip", home, cwd=home)
    python = home / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python)
    run(*pip, "install", "-q", "--no-deps", "--no-index", wheel, cwd=home)
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=home)
    linked = home / "dependencies"
    linked.mkdir()
    for needed in closure(requires):
        link_packages(needed, linked)
    (Path(site.stdout.strip()) / "dependencies.pth").write_text(f"{linked}\n")


def closure(requirements: Iterable[Requirement]) -> Iterator[Distribution]:
    """The installed distributions the requirements need with EXTRAS, and theirs, once each."""
    seen: set[str] = set()
    todo = [(requirement, EXTRAS) for requirement in requirements]
    while todo:
        requirement, extras = todo.pop()
        wanted = ("", *extras)
        if requirement.marker and not any(
            requirement.marker.evaluate({"extra": extra}) for extra in wanted
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name == "mersal-bus":
            continue  # an extra naming others of its own (prometheus: otel, health)
        key = f"{name}{sorted(requirement.extras)}"
        if key in seen:
            continue
        seen.add(key)
        try:
            found = distribution(name)
        except PackageNotFoundError:
            pytest.fail(f"{requirement} is not installed here, so it cannot be lent to the venv")
        yield found
        todo.extend((Requirement(line), tuple(requirement.extras)) for line in found.requires or [])


def link_packages(found: Distribution, into: Path) -> None:
    """Symlink what `found` installed at the top of its site-packages into `into`.

    Its metadata too: some packages ask `importlib.metadata` for their dependencies' versions.
    """
    for top in {path.parts[0] for path in found.files or []}:
        if top in ("..", "__pycache__") or top.endswith(".pth"):
            continue
        target = into / top
        if not target.exists():
            target.symlink_to(Path(str(found.locate_file(top))))


def test_the_installed_wheel_imports_from_the_venv_with_its_version(
    venv: Path, tmp_path: Path
) -> None:
    ran = run(
        venv / "bin" / "python",
        "-c",
        "import importlib.metadata, mersal, mersal_rabbitmq, mersal_sqlalchemy\n"
        "print(importlib.metadata.version('mersal-bus'))\n"
        "for package in (mersal, mersal_rabbitmq, mersal_sqlalchemy):\n"
        "    print(package.__file__)",
        cwd=tmp_path,
    )
    version, *files = ran.stdout.splitlines()
    assert version == VERSION
    assert [Path(file).is_relative_to(venv) for file in files] == [True, True, True]


def test_the_installed_mersal_command_has_the_adapters_commands_and_migrates(
    venv: Path, tmp_path: Path
) -> None:
    usage = run(venv / "bin" / "mersal", "--help", cwd=tmp_path).stdout.splitlines()[0]
    assert usage == "usage: mersal [-h] {run,dlq,status,db,failures,outbox,queues} ..."
    database = f"sqlite+aiosqlite:///{tmp_path / 'orders.db'}"
    upgraded = run(venv / "bin" / "mersal", "db", "upgrade", "--database", database, cwd=tmp_path)
    assert upgraded.stdout == (
        f"the outbox, inbox and saga tables in {database} are at {HEAD_REVISION} (head)\n"
    )
    with sqlite3.connect(tmp_path / "orders.db") as connection:
        tables = {row[0] for row in connection.execute("select name from sqlite_master")}
    assert set(made_by(DEFAULT_OUTBOX, DEFAULT_INBOX)) <= tables  # each revision's table
