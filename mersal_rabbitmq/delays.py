"""Delayed delivery without a plugin: wait queues whose TTL dead-letters into the destination.

RabbitMQ 3.10 has no delay plugin, so a message whose deliver-at lies in the future first goes
to a wait queue of its destination, `<queue>.wait.<ms>`: durable, `x-message-ttl=<ms>`,
dead-lettering through the default exchange with `x-dead-letter-routing-key=<queue>`. When the
TTL runs out the broker moves the message to its queue. All messages of one wait queue share
its TTL, so they expire in order at its head (per-message TTLs would wait behind longer ones).
The delay left at send time is rounded UP to two significant digits (1234 ms waits 1300 ms):
never early, at most 10% late, and at most 90 wait queues per decade of delay per destination.
A delayed publish waits in `mersal.events.<topic>.wait.<ms>`, which dead-letters into the topic
exchange. Quorum wait queues dead-letter at-least-once. Wait queues are not removed
automatically: `x-expires` ignores publishes and could drop waiting messages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MAX_WAIT_MS = 4_200_000_000  # the largest two-digit bucket under RabbitMQ's 2**32 - 1 ms TTL cap
"""The longest wait, in milliseconds, a wait queue's TTL can hold."""


def wait_milliseconds(delay: float) -> int:
    """A delay in milliseconds rounded up to two significant digits: 1234 ms waits 1300."""
    milliseconds = max(1, math.ceil(delay * 1000))
    scale = int(10 ** max(0, len(str(milliseconds)) - 2))
    return -(-milliseconds // scale) * scale


def wait_queue_name(exchange: str, routing_key: str, milliseconds: int) -> str:
    """`<queue>.wait.<ms>` for a send, `mersal.events.<topic>.wait.<ms>` for a publish."""
    prefix = f"{exchange}.{routing_key}" if exchange else routing_key
    return f"{prefix}.wait.{milliseconds}"


def retry_wait_queues(queue: str, delays: Iterable[float]) -> list[str]:
    """The wait queues that delayed retries of `delays` seconds go through on their way to `queue`.

    The delay left at publish time is a little shorter than the retry's, so a delay on a
    bucket's edge can land in the bucket below: `mersal status` also lists the queues the broker
    has.
    """
    return [wait_queue_name("", queue, wait_milliseconds(delay)) for delay in delays if delay > 0]


def waiting_for(name: str) -> tuple[str, int] | None:
    """The queue a wait queue `<queue>.wait.<ms>` delivers to, and its milliseconds; else None."""
    queue, separator, milliseconds = name.rpartition(".wait.")
    if not separator or not queue or not (milliseconds.isascii() and milliseconds.isdigit()):
        return None
    return queue, int(milliseconds)
