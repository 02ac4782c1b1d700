"""The fuzz tests' app: one per test, shared by all of that test's examples."""

from collections.abc import Iterator

import pytest

from tests.fuzz.rig import Rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A started app on a private memory broker, warmed up; stopped after the test."""
    started = Rig()
    started.start()
    try:
        yield started
    finally:
        started.stop()
