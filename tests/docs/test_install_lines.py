"""Every `pip install` the docs and the code show installs this project, never PyPI's `mersal`.

PyPI's `mersal` is an unrelated project; ours is `mersal-bus`, installed from a checkout (`.`),
from a wheel that `make dist` built, or, once installed, by name to add an extra.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = set(PROJECT["optional-dependencies"])
VERSION = PROJECT["version"]

INSTALL = re.compile(r"\bpip install ([^`\"\n#]*)")
"""A command and its arguments, up to the end of its code span, string, line or comment."""

WITH_EXTRAS = r"(?:\[(?P<extras>[a-z]+(?:,[a-z]+)*)\])?"
OURS = [
    re.compile(rf"mersal-bus{WITH_EXTRAS}"),
    re.compile(rf"\.{WITH_EXTRAS}"),
    re.compile(rf"/path/to/checkout{WITH_EXTRAS}"),
    re.compile(rf"dist/mersal_bus-{re.escape(VERSION)}-py3-none-any\.whl{WITH_EXTRAS}"),
]
"""What an argument naming this project may be: the distribution, a checkout, the wheel."""


def shown_in() -> list[Path]:
    """The README, the docs pages, and the code whose texts and docstrings users read."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    code = [
        path
        for package in ("mersal", "mersal_rabbitmq", "mersal_sqlalchemy", "examples")
        for path in sorted((ROOT / package).rglob("*.py"))
    ]
    return pages + code


def installs() -> list[tuple[str, str]]:
    """Every `pip install ...` as (where, the arguments)."""
    found = []
    for path in shown_in():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for command in INSTALL.finditer(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", command.group(1).strip()))
    return found


INSTALLS = installs()


def test_the_docs_and_the_readme_show_how_to_install() -> None:
    places = {where.partition(":")[0] for where, _ in INSTALLS}
    assert {"README.md", "docs/setup/install.md", "docs/quickstart.md"} <= places


@pytest.mark.parametrize(("where", "arguments"), INSTALLS, ids=[where for where, _ in INSTALLS])
def test_each_install_names_mersal_bus_a_checkout_or_the_wheel(where: str, arguments: str) -> None:
    words = [word.rstrip(",;:)") for word in shlex.split(arguments)]
    requirements = [word for word in words if word and not word.startswith("-")]
    assert requirements, f"{where}: `pip install {arguments}` installs nothing"
    for requirement in requirements:
        if not requirement.startswith(("mersal", ".", "/", "dist/")):
            continue  # another package (pip install atheris) or prose after the command
        matched = next((m for p in OURS if (m := p.fullmatch(requirement))), None)
        assert matched is not None, (
            f"{where}: `pip install {arguments}`: {requirement!r} is not mersal-bus, a checkout "
            "or dist/'s wheel (PyPI's `mersal` is another project)"
        )
        extras = set((matched.group("extras") or "").split(",")) - {""}
        assert extras <= EXTRAS, f"{where}: no extra {sorted(extras - EXTRAS)} in pyproject.toml"
