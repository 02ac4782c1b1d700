"""The code in docs/operations.md's health and OpenTelemetry sections runs as it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

OPERATIONS = Path(__file__).parents[1] / "docs" / "operations.md"
HEALTH = "## Health: `app.health()`, `/livez`, `/readyz`"
TELEMETRY = "## Tracing and metrics: OpenTelemetry"


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
