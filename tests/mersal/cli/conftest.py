"""Fixtures of the `mersal` command's tests."""

import sys
from collections.abc import Callable
from pathlib import Path
from uuid import uuid4

import pytest

ASYNC_FACTORY = """
import asyncio

from mersal import App


async def make_app() -> App:
    await asyncio.sleep(0)  # runs in the loop that serves (or loads) the app
    return App("{name}", transport="memory://")
"""


@pytest.fixture
def async_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Write a module whose async `make_app` returns an App named as asked; its `--app` target.

    The module lies in the test's directory, importable from it and from this process.
    """

    def write(name: str) -> str:
        module = f"factory_{uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(ASYNC_FACTORY.format(name=name))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, module, raising=False)
        return f"{module}:make_app"

    return write
