"""Fixtures for the App behaviour tests on the memory transport."""

import asyncio
from collections.abc import Awaitable, Callable
from uuid import uuid4

import pytest

Until = Callable[..., Awaitable[None]]


@pytest.fixture
def memory_url() -> str:
    """A memory transport URL whose broker no other test shares."""
    return f"memory://core-{uuid4().hex}"


@pytest.fixture
def until() -> Until:
    """`await until(predicate, timeout=...)`: poll a condition, fail the test if it never holds."""

    async def wait(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if predicate():
                        return
                    await asyncio.sleep(0.001)
        except TimeoutError:
            pytest.fail(f"condition not met within {timeout}s: {predicate}")

    return wait
