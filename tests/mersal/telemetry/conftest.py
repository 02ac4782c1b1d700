"""Fixtures for the telemetry tests: providers recording in memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mersal.telemetry.support import Recorder


@pytest.fixture
def otel() -> Iterator[Recorder]:
    """Providers recording in memory, shut down after the test."""
    recorder = Recorder()
    yield recorder
    recorder.shutdown()
