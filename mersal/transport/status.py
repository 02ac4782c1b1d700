"""What a transport says of its queues when asked for `mersal status`: counts, nothing changed."""

from __future__ import annotations

from dataclasses import dataclass

INPUT = "input"
ERROR = "error"
WAIT = "wait"
QUEUE = "queue"


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


@dataclass(frozen=True)
class QueueReport:
    """A transport's answer to `queue_status`: the queues, and why unknown counts are unknown."""

    queues: list[QueueStatus]
    note: str | None = None
