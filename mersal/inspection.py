"""What a transport and a storage tell `mersal status` when asked what they hold: counts only.

A transport that can count its queues is a `QueueInspector`, a storage that can count its
outbox and inbox rows a `StorageInspector`; neither changes anything by answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class QueueInspector(Protocol):
    """A transport that can count the messages in its queues without changing anything."""

    async def queue_status(
        self,
        names: Sequence[str],
        *,
        waits_of: Sequence[str] = (),
        delays: Sequence[float] = (),
        management: str | None = None,
    ) -> QueueReport:
        """Each named queue's counts, then the existing wait queues of the `waits_of` queues.

        `delays` (seconds) are the delayed retries, whose wait queues are looked for by name;
        `management` is the broker's monitoring API, for a transport that has one.
        """
        ...


@dataclass(frozen=True)
class QueueReport:
    """A transport's answer to `queue_status`: the queues, and why unknown counts are unknown."""

    queues: list[QueueStatus]
    note: str | None = None


INPUT = "input"
"""The role of an app's input queue (and of its partitions)."""
ERROR = "error"
"""The role of an error queue."""
WAIT = "wait"
"""The role of a wait queue, where delayed messages wait."""
QUEUE = "queue"
"""The role of a queue named on the command line (`--queue`)."""


@dataclass(frozen=True)
class QueueStatus:
    """A queue as the broker counts it; None where a count is unknown."""

    name: str
    exists: bool = True
    ready: int | None = None
    unacked: int | None = None
    consumers: int | None = None
    role: str = QUEUE
    """input, error, wait (a wait queue of `wait_of`) or queue (named with --queue)."""
    wait_of: str | None = None
    """For a wait queue: the queue its messages go back to once their delay is over."""


@runtime_checkable
class StorageInspector(Protocol):
    """A storage that can count its outbox and inbox rows without changing anything."""

    async def status(self, *, every_app: bool = False) -> StorageStatus:
        """The app's outbox and inbox counts (every app's with `every_app`)."""
        ...


@dataclass(frozen=True)
class StorageStatus:
    """The outbox and inbox as the database counts them (one app's rows, or every app's)."""

    pending: int
    parked: int
    oldest_pending_age: float | None
    """Seconds since the oldest pending row was committed; None when none is pending."""
    inbox: int
    app: str | None = None
    """Whose rows were counted; None for every app's."""
    apps: tuple[AppRows, ...] = ()
    """Every app's outbox rows in the database, by app name (send-only apps' too)."""
    failures: int | None = None
    """Failed messages in the dead-letter store (of `app`, or every app's); None: no store."""

    @property
    def others(self) -> bool:
        """Whether the outbox holds rows of an app other than the one counted."""
        return any(rows.app != self.app for rows in self.apps)


@dataclass(frozen=True)
class AppRows:
    """One app's rows in a shared outbox: the app that committed them (its `source`)."""

    app: str
    pending: int
    parked: int
    oldest_pending_age: float | None
    """Seconds since its oldest pending row was committed; None when none is pending."""
