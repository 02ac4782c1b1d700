"""The code in docs/operations.md's OpenTelemetry section runs as it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"
SECTION = "## Tracing and metrics: OpenTelemetry"


def python_blocks() -> list[str]:
    """The fenced python blocks of the section, in order."""
    text = OPERATIONS.read_text()
    section = text[text.index(SECTION) :]
    following = section.find("\n## ", len(SECTION))
    if following != -1:
        section = section[:following]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_section_shows_code() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("number", range(len(python_blocks())))
def test_each_code_block_runs(number: int, tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MERSAL_", "OTEL_"))}
    result = subprocess.run(
        [sys.executable, "-c", python_blocks()[number]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=environment,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    if number == 0:  # the console exporters print the handled message's spans and metrics
        assert '"name": "process orders"' in result.stdout
        assert '"name": "messaging.process.duration"' in result.stdout
