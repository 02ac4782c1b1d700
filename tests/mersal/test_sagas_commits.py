"""The memory saga store's commits: all of a message's sagas or none, undone when sending fails.

Also what a saga method can get wrong: data of another class, a timeout from `not_found`, a
correlation function that raises.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from mersal import App, Outgoing, RetryPolicy
from mersal.sagas import Saga
from mersal.testing import Harness
from mersal.transport.memory import MemoryTransport
from tests.support import DelegatingTransport, eventually


@dataclass
class Hit:
    key: str


@dataclass
class Pay:
    key: str


@dataclass
class Ship:
    key: str


@dataclass
class Overdue:
    key: str


@dataclass
class Count:
    key: str = ""
    hits: int = 0


class PerKey(Saga[Count], name="tests.commits.PerKey"):
    started_by = (Hit,)
    correlation = {Hit: "key"}

    async def hit(self, message: Hit) -> None:
        self.data.hits += 1
        await asyncio.sleep(0)


class Shared(Saga[Count], name="tests.commits.Shared"):
    started_by = (Hit,)
    correlation = {Hit: lambda message: "all"}

    async def hit(self, message: Hit) -> None:
        self.data.hits += 1
        await asyncio.sleep(0)


def app_named(name: str, transport: object = None) -> App:
    return App(
        name,
        transport=transport,  # type: ignore[arg-type]
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{name}.error"),
        concurrency=16,
    )


async def test_a_message_for_two_sagas_commits_both_or_neither() -> None:
    app = app_named("commits")
    app.register_saga(PerKey)
    app.register_saga(Shared)
    app.route(Hit, "commits")
    async with Harness(app) as bus:
        await asyncio.gather(*(app.send(Hit(f"k-{n}")) for n in range(40)))
        await bus.idle()
        per_key: list[Count | None] = []
        for n in range(40):
            per_key.append(await bus.saga_data(PerKey, f"k-{n}"))
        shared = await bus.saga_data(Shared, "all")
    assert bus.dead_lettered == []
    assert shared == Count(hits=40)  # conflicts on the shared saga reran the messages ...
    assert per_key == [Count(hits=1)] * 40  # ... without applying their own saga twice


class Paid(Saga[Count], name="tests.commits.Paid"):
    started_by = (Pay,)
    correlation = {Pay: "key"}

    def __init__(self, app: App) -> None:
        self.app = app

    async def pay(self, message: Pay) -> None:
        self.data.hits += 1
        if self.data.hits == 1:
            await self.app.send(Ship(message.key))


class FailsFirstShip(DelegatingTransport):
    """A transport whose first send of a `Ship` fails."""

    failed = False

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        if not self.failed and any("Ship" in o.envelope.headers.get("type", "") for o in messages):
            self.failed = True
            return [ConnectionError("the broker hiccuped") for _ in messages]
        return await self.inner.send_each(messages)


async def test_a_failed_send_undoes_the_sagas_change_so_the_retry_sends_again() -> None:
    name = f"paid-{uuid.uuid4().hex[:8]}"
    transport = FailsFirstShip(MemoryTransport(f"memory://{name}"))
    app = App(
        name,
        transport=transport,  # type: ignore[arg-type]  # a Transport by duck typing
        retry=RetryPolicy(immediate=2, delayed=[]),
    )
    shipped: list[Ship] = []

    async def ship(message: Ship) -> None:
        shipped.append(message)

    app.register_saga(Paid)
    app.register(Ship, ship)
    app.route(Pay, name)
    app.route(Ship, name)
    async with app:
        await app.send(Pay("o-1"))
        await eventually(lambda: shipped == [Ship("o-1")], "the Ship sent by the retry")
        await eventually(lambda: app.in_flight == 0, "the Pay settled")
        assert transport.failed
        assert await app.saga_data(Paid, "o-1") == Count(hits=1)


@dataclass
class Other:
    hits: int = 0


class Careless(Saga[Count], name="tests.commits.Careless"):
    started_by = (Hit,)
    correlation = {Hit: "key"}

    async def hit(self, message: Hit) -> None:
        self.data = Other(hits=7)  # type: ignore[assignment]


async def test_data_of_another_class_is_refused_not_saved() -> None:
    app = app_named("careless")
    app.register_saga(Careless)
    app.route(Hit, "careless")
    async with Harness(app) as bus:
        await app.send(Hit("k"))
        await bus.idle()
        assert await bus.saga_data(Careless, "k") is None
    [dead] = bus.dead_lettered
    assert "Careless.data is a Other" in dead.error_message
    assert "not a Count" in dead.error_message


class Lonely(Saga[Count], name="tests.commits.Lonely"):
    started_by = (Hit,)
    correlation = {Hit: "key", Pay: "key"}

    async def hit(self, message: Hit) -> None:
        pass

    async def pay(self, message: Pay) -> None:
        pass

    async def overdue(self, timeout: Overdue) -> None:
        pass

    async def not_found(self, message: object) -> None:
        await self.request_timeout(1, Overdue("x"))


async def test_a_timeout_requested_in_not_found_is_refused() -> None:
    app = app_named("lonely")
    app.register_saga(Lonely)
    app.route(Pay, "lonely")
    async with Harness(app) as bus:
        await app.send(Pay("nobody"))
        await bus.idle()
    [dead] = bus.dead_lettered
    assert "not in not_found, where there is no saga" in dead.error_message
    assert bus.deferred == []


def broken(message: Hit) -> str:
    raise KeyError(message.key)


class Broken(Saga[Count], name="tests.commits.Broken"):
    started_by = (Hit,)
    correlation = {Hit: broken}

    async def hit(self, message: Hit) -> None:
        pass


async def test_a_correlation_that_raises_dead_letters_at_once() -> None:
    app = App("broken", retry=RetryPolicy(immediate=3, delayed=[1.0]))
    app.register_saga(Broken)
    app.route(Hit, "broken")
    async with Harness(app) as bus:
        await app.send(Hit("k"))
        await bus.idle(include_delayed=False)
    [dead] = bus.dead_lettered
    assert dead.attempts == 1
    assert dead.error_type == "mersal.sagas.InvalidCorrelation"
    assert "raised KeyError" in dead.error_message
