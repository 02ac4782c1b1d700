"""Helpers shared by the test suites."""

from __future__ import annotations

import os
import shutil
import subprocess

SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def rabbitmqctl(*args: str) -> str:
    """Run `rabbitmqctl -q ARGS` and return its output; fail the test if it fails."""
    command = shutil.which("rabbitmqctl", path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if command is None:
        raise FileNotFoundError("rabbitmqctl")
    result = subprocess.run(
        [command, "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr or result.stdout}")
    return result.stdout
