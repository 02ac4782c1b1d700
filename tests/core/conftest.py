"""Fixtures for the App behaviour tests on the memory transport."""

from uuid import uuid4

import pytest


@pytest.fixture
def memory_url() -> str:
    """A memory transport URL whose broker no other test shares."""
    return f"memory://core-{uuid4().hex}"
