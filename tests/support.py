"""Helpers shared by the test suites."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from mersal.transport import Consumer, Limits, Outgoing, Transport, first_failure

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


class DelegatingTransport:
    """A transport that hands every call to `inner`: tests override what they change.

    `send` goes through `send_each`, so overriding `send_each` changes both.
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.address = inner.address

    @property
    def limits(self) -> Limits:
        """The inner transport's limits."""
        return self.inner.limits

    async def start(self) -> None:
        """Connect."""
        await self.inner.start()

    async def stop(self) -> None:
        """Disconnect."""
        await self.inner.stop()

    async def declare(self, queue: str, *, temporary: bool = False) -> None:
        """Declare a queue."""
        await self.inner.declare(queue, temporary=temporary)

    async def bind(self, queue: str, topic: str) -> None:
        """Bind a queue to a topic."""
        await self.inner.bind(queue, topic)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Send, raising the first failure."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Send each; for each, None or why not."""
        return await self.inner.send_each(messages)

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume from a queue."""
        return await self.inner.consume(queue, prefetch=prefetch)
