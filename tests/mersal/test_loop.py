"""The loop choice: uvloop when installed, asyncio's on request, clear errors otherwise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from mersal import loop
from mersal.errors import ConfigurationError


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("MERSAL_LOOP", raising=False)
    assert loop.chosen() == "uvloop"
    assert loop.run(loop_module()).startswith("uvloop")


def test_asyncio_is_used_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERSAL_LOOP", "asyncio")
    assert loop.chosen() == "asyncio"
    assert loop.run(loop_module()).startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_asked_for_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    monkeypatch.delenv("MERSAL_LOOP", raising=False)
    assert loop.chosen() == "asyncio"
    assert loop.run(loop_module()).startswith("asyncio")
    with pytest.raises(ConfigurationError, match=r"pip install 'mersal-bus\[fast\]'"):
        loop.chosen("uvloop")


def test_an_unknown_choice_names_the_choices() -> None:
    main = loop_module()
    with pytest.raises(ConfigurationError, match="auto, uvloop, asyncio"):
        loop.run(main, "trio")
    assert main.cr_frame is None  # closed, not left to warn "never awaited"
