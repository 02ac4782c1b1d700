"""docs/operations.md: its command table names every `mersal` sub-command, the page (or a page
the table links to) names every option, and the code in its health and OpenTelemetry sections
runs as it is."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

import pytest

from mersal.cli import main

OPERATIONS = Path(__file__).parents[1] / "docs" / "operations.md"
HEALTH = "## Health: `app.health()`, `/livez`, `/readyz`"
TELEMETRY = "## Tracing and metrics: OpenTelemetry"


def command_help(command: list[str]) -> str:
    """What `mersal COMMAND --help` prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main([*command, "--help"])
    return printed.getvalue()


def commands(command: list[str] | None = None) -> list[list[str]]:
    """Every sub-command the installed `mersal` has, down to the ones that take no other."""
    command = command or []
    usage = command_help(command).split("\n\n")[0]
    group = re.search(r"\{([\w,-]+)\} \.\.\.", usage)  # argparse's sub-commands, not choices
    if group is None:
        return [command]
    return [found for name in group[1].split(",") for found in commands([*command, name])]


def table() -> str:
    """The command table at the top of the page."""
    return OPERATIONS.read_text().split("\n## ")[0]


def table_commands() -> set[str]:
    """The sub-commands the table has a row for: "db upgrade", "run", ..."""
    rows = re.findall(r"^\| `mersal ([^`]+)` \|", table(), flags=re.MULTILINE)
    return {" ".join(takewhile(lambda word: word.isalpha(), row.split())) for row in rows}


def test_the_table_has_a_row_for_every_sub_command() -> None:
    installed = {" ".join(command) for command in commands()}
    assert len(installed) > 10
    assert installed - table_commands() == set(), "docs/operations.md's table lacks these"
    assert table_commands() - installed == set(), "docs/operations.md's table has no such"


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_every_option_is_on_the_page_or_a_page_the_table_links_to(command: list[str]) -> None:
    linked = set(re.findall(r"\]\(([\w/-]+\.md)", table()))
    pages = [OPERATIONS, *(OPERATIONS.parent / page for page in sorted(linked))]
    text = "".join(page.read_text() for page in pages)
    options = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", command_help(command))) - {"--help"}
    missing = sorted(option for option in options if option not in text)
    assert not missing, f"`mersal {' '.join(command)}`: docs/operations.md does not say {missing}"


def python_blocks(heading: str) -> list[str]:
    """The fenced python blocks of the section under `heading`, in order."""
    text = OPERATIONS.read_text()
    section = text[text.index(heading) :]
    following = section.find("\n## ", len(heading))
    if following != -1:
        section = section[:following]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def run(code: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run `code` in a new interpreter, without the MERSAL_ and OTEL_ environment."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MERSAL_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=directory,
        env=environment,
        check=False,
    )


def test_the_sections_show_code() -> None:
    assert len(python_blocks(HEALTH)) == 1
    assert len(python_blocks(TELEMETRY)) >= 2


def test_the_health_sample_runs(tmp_path: Path) -> None:
    result = run(python_blocks(HEALTH)[0], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Health(live=False, ready=False, checks={'app': ")


@pytest.mark.parametrize("number", range(len(python_blocks(TELEMETRY))))
def test_each_telemetry_code_block_runs(number: int, tmp_path: Path) -> None:
    result = run(python_blocks(TELEMETRY)[number], tmp_path)
    assert result.returncode == 0, result.stderr
    if number == 0:  # the console exporters print the handled message's spans and metrics
        assert '"name": "process orders"' in result.stdout
        assert '"name": "messaging.process.duration"' in result.stdout
