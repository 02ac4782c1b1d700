"""`import mersal` refuses an environment where PyPI's unrelated `mersal` distribution is installed.

Each case runs in a fresh interpreter: the check runs once, when the package is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFLICT = (
    "mersal.errors.ConfigurationError: the unrelated `mersal` distribution (0.12, in {where}) "
    "is installed beside mersal-bus and both ship the import package `mersal`: "
    "`pip uninstall mersal mersal-bus`, then install mersal-bus again "
    "(uninstalling `mersal` removes files the two share)"
)


def installed_as(folder: Path, version: str, entry_points: str = "") -> Path:
    """A dist-info named `mersal` in `folder`, as pip leaves one; `folder`."""
    info = folder / f"mersal-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mersal\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)
    return folder


def python(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with `folder` first on the path, then this checkout."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def unrelated(tmp_path: Path) -> Path:
    """A path entry holding the metadata of PyPI's `mersal` 0.12."""
    return installed_as(tmp_path, "0.12")


def test_importing_mersal_beside_the_unrelated_mersal_says_to_uninstall_it(
    unrelated: Path,
) -> None:
    ran = python(unrelated, "-c", "import mersal")
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1] == CONFLICT.format(where=unrelated)


def test_the_mersal_command_beside_the_unrelated_mersal_says_to_uninstall_it(
    unrelated: Path,
) -> None:
    ran = python(unrelated, "-m", "mersal.cli", "--help")
    assert ran.returncode == 1
    assert ran.stdout == ""
    assert ran.stderr.splitlines()[-1] == CONFLICT.format(where=unrelated)


def test_this_project_installed_under_its_former_name_is_no_conflict(tmp_path: Path) -> None:
    former = installed_as(tmp_path, "0.1.0", "[console_scripts]\nmersal = mersal.cli:main\n")
    ran = python(former, "-c", "import mersal; print(mersal.App.__name__)")
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "App\n", "")
