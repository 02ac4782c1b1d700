"""Saga timeouts on RabbitMQ with a PostgreSQL outbox, and what a hostile producer's headers do.

A timeout leaves through the outbox with the message that requested it, waits in a wait queue
(`<queue>.wait.<ms>`, TTL then dead-lettered into the app's queue) and comes back to its saga by
the `saga-id` header.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aio_pika
import pytest
from lagom import Container

from mersal import App, Header, RetryPolicy
from mersal.sagas import Saga, StoredSaga, saga_check
from tests.mersal_sqlalchemy.support import count, storage_of
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration

DELAY = 1.0


@dataclass
class Begin:
    key: str
    delay: float = DELAY


@dataclass
class Poke:
    key: str


@dataclass
class Finish:
    key: str


@dataclass
class Due:
    """The saga's timeout: a method, no correlation."""

    key: str


@dataclass
class Watch:
    key: str = ""
    pokes: int = 0
    due: bool = False


@dataclass
class Probe:
    runs: Counter[str] = field(default_factory=Counter)
    requested_at: dict[str, float] = field(default_factory=dict)
    due_at: dict[str, float] = field(default_factory=dict)
    saga_ids: dict[str, str] = field(default_factory=dict)


class Watches(Saga[Watch], name="tests.sagas.Watches"):
    started_by = (Begin,)
    correlation = {Begin: "key", Poke: "key", Finish: "key"}

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    async def begin(self, message: Begin) -> None:
        self.probe.runs["begin"] += 1
        self.probe.saga_ids[message.key] = self.saga_id
        self.data.key = message.key
        self.probe.requested_at[message.key] = time.monotonic()
        await self.request_timeout(message.delay, Due(message.key))

    async def poke(self, message: Poke) -> None:
        self.probe.runs["poke"] += 1
        self.data.pokes += 1

    async def finish(self, message: Finish) -> None:
        self.probe.runs["finish"] += 1
        self.mark_complete()

    async def due(self, timeout: Due) -> None:
        self.probe.runs["due"] += 1
        self.probe.due_at[timeout.key] = time.monotonic()
        self.data.due = True


def watch_app(name: str, broker: Broker, database: str, probe: Probe, concurrency: int = 32) -> App:
    container = Container()
    container[Probe] = probe
    app = App(
        name,
        transport=broker.url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{name}.error"),
        container=container,
        concurrency=concurrency,
    )
    app.register_saga(Watches)
    for message_type in (Begin, Poke, Finish):
        app.route(message_type, name)
    return broker.watch(app)


async def handled(app: App, n: int) -> bool:
    """Whether the app's inbox holds `n` handled messages (committed, whatever they did)."""
    storage = storage_of(app)
    return await count(storage.engine, storage.tables.inbox) >= n


async def saga_row(app: App, key: str) -> StoredSaga | None:
    return await storage_of(app).sagas.read(Watches.saga_name, key)


async def test_a_timeout_arrives_after_its_delay_through_the_outbox_and_a_wait_queue(
    broker: Broker, prefix: str, postgres_url: str
) -> None:
    probe = Probe()
    app = watch_app(f"{prefix}.watch", broker, postgres_url, probe)
    sender = App(f"{prefix}.sender", transport=broker.url, consume=False)  # no outbox
    sender.route(Begin, app.name)
    async with app, broker.watch(sender):
        relay = storage_of(app).relay
        assert relay is not None
        await sender.send(Begin("k-1"))
        await eventually(lambda: probe.due_at.get("k-1"), "the timeout handled", timeout=10)
        await eventually(lambda: app.in_flight == 0, "the timeout settled")

        elapsed = probe.due_at["k-1"] - probe.requested_at["k-1"]
        print(f"a {DELAY:g}s timeout came back after {elapsed:.3f}s")
        assert DELAY - 0.05 <= elapsed < DELAY + 4
        assert await app.saga_data(Watches, "k-1") == Watch("k-1", due=True)
        row = await saga_row(app, "k-1")
        assert row is not None and row.revision == 2 and row.id == probe.saga_ids["k-1"]
        assert relay.published == 1  # the timeout: the only message that left by the outbox
        assert [q for q in app.transport.queues if ".wait." in q]  # type: ignore[attr-defined]
        assert await count(storage_of(app).engine, storage_of(app).tables.outbox) == 0
        assert await broker.count(f"{app.name}.error") == 0
    assert probe.runs == Counter(begin=1, due=1)


async def test_a_timeout_of_a_saga_completed_meanwhile_is_ignored(
    broker: Broker, prefix: str, postgres_url: str
) -> None:
    probe = Probe()
    app = watch_app(f"{prefix}.watch", broker, postgres_url, probe)
    async with app:
        await app.send(Begin("k-2"))
        await eventually(lambda: saga_row(app, "k-2"), "the saga started")
        await app.send(Finish("k-2"))
        await eventually(lambda: handled(app, 2), "the Finish handled")
        assert await saga_row(app, "k-2") is None

        await eventually(lambda: handled(app, 3), "the timeout handled", timeout=10)
        await eventually(lambda: app.in_flight == 0, "the timeout settled")

        assert await saga_row(app, "k-2") is None
        assert await app.saga_data(Watches, "k-2") is None
        assert await broker.count(f"{app.name}.error") == 0
    assert probe.runs == Counter(begin=1, finish=1)  # the timeout's method did not run


def forged(app: App, message: object, headers: dict[str, str]) -> aio_pika.Message:
    """A raw AMQP message as another producer would publish it, with its own headers."""
    return aio_pika.Message(
        app.codec.encode(message),
        message_id=str(uuid.uuid4()),
        type=app.types.name_of(type(message)),
        content_type=app.codec.content_type,
        headers=dict(headers),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


async def test_messages_with_forged_saga_headers_are_handled_as_their_types(
    broker: Broker, prefix: str, postgres_url: str
) -> None:
    """Saga headers a producer made up or copied: each message is handled, none acked unseen.

    A start message starts its saga, a correlated one reaches the saga its correlation value
    finds, whatever saga type or id the headers name; the timeout type (Due), which reaches a
    saga only as a timeout, reaches the saga its id names without a valid `saga-check` (a
    timeout requested before the check existed), and goes to the error queue when none has it.
    """
    probe = Probe()
    # One at a time: the pokes of one saga would otherwise race and rerun, and each run counts.
    app = watch_app(f"{prefix}.watch", broker, postgres_url, probe, concurrency=1)

    async def publish(message: object, headers: dict[str, str]) -> None:
        """A forged message to the app, as another producer sends it."""
        await broker.publish(forged(app, message, headers), app.name)

    async with app:
        nobody = str(uuid.uuid4())
        ours = {Header.SAGA_ID: nobody, Header.SAGA_TYPE: Watches.saga_name}
        theirs = {Header.SAGA_ID: nobody, Header.SAGA_TYPE: "someone.Else"}
        await publish(Begin("k-3", delay=3600), ours)
        await eventually(lambda: saga_row(app, "k-3"), "the forged Begin started its saga")
        saga_id = probe.saga_ids["k-3"]
        assert saga_id != nobody

        await publish(Poke("k-3"), ours)
        await publish(Poke("k-3"), theirs)
        real_id_other_type = {Header.SAGA_ID: saga_id, Header.SAGA_TYPE: "someone.Else"}
        await publish(Poke("k-3"), real_id_other_type)
        await publish(Begin("k-4", delay=3600), theirs)
        real_id = {Header.SAGA_ID: saga_id, Header.SAGA_TYPE: Watches.saga_name}
        await publish(Due("k-3"), ours)  # a timeout type
        await publish(Due("k-3"), real_id)  # with no saga-check
        await eventually(lambda: handled(app, 6), "the forged messages handled")

        async def refused() -> bool:
            return await broker.count(f"{app.name}.error") == 1

        await eventually(refused, "the made-up timeout in the error queue")
        await eventually(lambda: app.in_flight == 0, "the forged messages settled")

        assert probe.runs == Counter(begin=2, poke=3, due=1)
        assert await app.saga_data(Watches, "k-3") == Watch("k-3", pokes=3, due=True)
        assert await app.saga_data(Watches, "k-4") == Watch("k-4")

        # With its real id, type and check, Due is this saga's own timeout: it runs.
        real = {**real_id, Header.SAGA_CHECK: saga_check(Watches.saga_name, saga_id)}
        await publish(Due("k-3"), real)
        await eventually(lambda: handled(app, 7), "the real Due handled")
        await eventually(lambda: app.in_flight == 0, "the Due settled")
        assert probe.runs == Counter(begin=2, poke=3, due=2)
        assert await app.saga_data(Watches, "k-3") == Watch("k-3", pokes=3, due=True)
