"""The decode fuzz target runs in the suite too: a short plain loop, in process and as a command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mersal.serialization import JsonCodec
from tests.fuzz import fuzz_decode

ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_step_only_ever_raises_decode_error() -> None:
    lines: list[str] = []

    target = fuzz_decode.fuzz(5_000, seed=20_240_611, report=lines.append)

    assert target.passed > 0, "no input decoded: the target no longer reaches the handler side"
    assert target.refused > 0
    assert lines[-1].endswith("no crash")


def test_every_seed_input_decodes_or_is_refused() -> None:
    target = fuzz_decode.Target()
    try:
        for data in fuzz_decode.seed_inputs():
            target.check(data)
    finally:
        target.close()

    assert target.passed >= 3  # one valid message of each registered type


def test_the_target_reports_any_other_exception_as_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: JsonCodec, body: bytes, cls: type) -> object:
        raise RuntimeError("a codec bug")

    monkeypatch.setattr(JsonCodec, "decode", broken)
    lines: list[str] = []

    with pytest.raises(RuntimeError, match="a codec bug"):
        fuzz_decode.fuzz(100, seed=1, report=lines.append)

    assert lines and lines[-1].startswith("crash on input bytes.fromhex(")


def test_the_target_runs_as_a_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.fuzz_decode", "--iterations", "300", "--seed", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "300 inputs" in result.stdout
    assert "no crash" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("atheris") is not None, reason="atheris is here")
def test_without_atheris_the_atheris_mode_says_how_to_get_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert fuzz_decode.main(["--atheris"]) == 2
    assert "pip install atheris" in capsys.readouterr().out
