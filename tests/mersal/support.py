"""Helpers the tests of tests/mersal share: looking into a memory broker, and an error queue
that refuses dead letters for a while."""

from __future__ import annotations

import json
from collections.abc import Sequence

from mersal import App, Envelope, MersalError
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryBroker, MemoryTransport
from tests.support import DelegatingTransport, eventually

ERROR_QUEUE = "error"


def qualified(cls: type) -> str:
    """`module.QualName` of a class, as the error-type header names it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def broker_of(app: App) -> MemoryBroker:
    """The memory broker under `app`'s transport (wrapped or not)."""
    transport = app.transport
    while isinstance(transport, DelegatingTransport):
        transport = transport.inner
    assert isinstance(transport, MemoryTransport)
    return transport.broker


def in_queue(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """The envelopes waiting in `queue`, in order."""
    return [stored.envelope for stored in broker.queues[queue].ready]


def settled(broker: MemoryBroker, queue: str) -> bool:
    """Whether `queue` has nothing ready and nothing unacknowledged."""
    found = broker.queues[queue]
    return not found.ready and not found.unacked


def assert_settled(broker: MemoryBroker, queue: str) -> None:
    """Nothing of `queue` is left ready or unacknowledged."""
    found = broker.queues[queue]
    assert found.unacked == 0, f"{queue}: {found.unacked} unacked"
    assert not found.ready, f"{queue}: {len(found.ready)} ready"


async def quiet(broker: MemoryBroker, app: App) -> None:
    """Wait until the broker is idle and the app has nothing in flight."""
    await eventually(
        lambda: broker.idle and app.in_flight == 0,
        "the broker idle and nothing in flight",
        timeout=5,
    )


async def dead_lettered(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """Wait until `queue` is settled and the error queue holds a dead letter; what it holds."""
    await eventually(
        lambda: settled(broker, queue) and bool(broker.queues[ERROR_QUEUE].ready),
        f"{queue!r} settled and a dead letter in the error queue",
    )
    return in_queue(broker, ERROR_QUEUE)


def number_of(envelope: Envelope) -> int:
    """The `n` field of a JSON body."""
    return int(json.loads(envelope.body)["n"])


class RefusingErrorQueue(DelegatingTransport):
    """A memory transport whose error queue refuses the first `refusals` messages sent to it."""

    def __init__(self, url: str, refusals: int, error: type[MersalError] = MersalError) -> None:
        super().__init__(MemoryTransport(url))
        self.refusals = refusals
        self.refused = 0
        self.error = error

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Refuse what goes to the error queue while refusals are left; send the rest."""
        results: list[Exception | None] = []
        for outgoing in messages:
            if outgoing.address == ERROR_QUEUE and self.refused < self.refusals:
                self.refused += 1
                results.append(self.error("the error queue is full (reject-publish), on purpose"))
            else:
                results.extend(await self.inner.send_each([outgoing]))
        return results
