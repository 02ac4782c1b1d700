"""Sagas in memory (no database): an app on the test Harness's memory broker.

The saga's methods await `asyncio.sleep(0)` between loading and saving, so that concurrent
messages for one saga interleave and conflict (and the conflicts are counted: method runs past
the number of messages).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from lagom import Container

from mersal import App, Header, RetryPolicy
from mersal.sagas import MemorySagaStore, Saga, StoredSaga
from mersal.testing import Harness, NotIdle

QUEUE = "orders"
ERRORS = "orders.error"
SAGA = "tests.sagas.Orders"


@dataclass
class Start:
    order_id: str
    n: int = 0
    timeout: float | None = None
    bad_timeout: bool = False


@dataclass
class Event:
    order_id: str
    n: int


@dataclass
class Finish:
    order_id: str


@dataclass
class Fail:
    order_id: str


@dataclass
class Note:
    order_id: str | None


@dataclass
class Expired:
    """The Orders saga's timeout (a method, no correlation)."""

    order_id: str


@dataclass
class Started:
    """What the saga publishes when it starts, through the App it was given."""

    order_id: str


@dataclass
class Unhandled:
    """A type the Orders saga has no method for."""

    n: int


@dataclass
class OrderData:
    order_id: str = ""
    starts: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    timed_out: bool = False


class Boom(Exception):
    """A saga method's failure on purpose."""


@dataclass
class Probe:
    """What the saga methods did, across every attempt (bound in the app's lagom Container)."""

    runs: Counter[str] = field(default_factory=Counter)
    saga_ids: list[str] = field(default_factory=list)
    not_found: list[object] = field(default_factory=list)
    apps: list[App] = field(default_factory=list)
    failures_left: int = 0


class Orders(Saga[OrderData], name=SAGA):
    started_by = (Start,)
    correlation = {
        Start: "order_id",
        Event: "order_id",
        Finish: "order_id",
        Fail: "order_id",
        Note: "order_id",
    }

    def __init__(self, app: App, probe: Probe) -> None:
        self.app = app
        self.probe = probe

    async def start(self, message: Start) -> None:
        self.probe.runs["start"] += 1
        self.probe.saga_ids.append(self.saga_id)
        self.probe.apps.append(self.app)
        await asyncio.sleep(0)
        self.data.order_id = message.order_id
        self.data.starts.append(message.n)
        if message.timeout is not None:
            await self.request_timeout(message.timeout, Expired(message.order_id))
        if message.bad_timeout:
            await self.request_timeout(1, Unhandled(1))
        await self.app.publish(Started(message.order_id))

    async def event(self, message: Event) -> None:
        self.probe.runs["event"] += 1
        await asyncio.sleep(0)
        self.data.events.append(message.n)

    async def finish(self, message: Finish) -> None:
        self.probe.runs["finish"] += 1
        self.mark_complete()

    async def fail(self, message: Fail) -> None:
        self.probe.runs["fail"] += 1
        self.data.events.append(-1)
        if self.probe.failures_left:
            self.probe.failures_left -= 1
            raise Boom("the saga method fails on purpose")

    async def note(self, message: Note) -> None:
        self.probe.runs["note"] += 1

    async def expired(self, timeout: Expired) -> None:
        self.probe.runs["expired"] += 1
        self.data.timed_out = True


class Hooked(Orders, name="tests.sagas.Hooked"):
    """Orders with a not_found hook of its own."""

    async def not_found(self, message: object) -> None:
        self.probe.not_found.append(message)


def orders_app(probe: Probe, saga: type[Orders] = Orders, retry: RetryPolicy | None = None) -> App:
    """The orders app: the saga, routes to its own queue; no retries unless `retry`."""
    container = Container()
    container[Probe] = probe
    app = App(
        QUEUE,
        retry=retry or RetryPolicy(immediate=0, delayed=[], error_queue=ERRORS),
        container=container,
    )
    app.register_saga(saga)
    for message_type in (Start, Event, Finish, Fail, Note):
        app.route(message_type, QUEUE)
    return app


async def stored(app: App, saga: type[Orders], correlation: str) -> StoredSaga | None:
    """The saga's committed row (id, revision, data), or None."""
    return await app.sagas.store().read(app.sagas.spec(saga).name, correlation)


def memory_store(app: App) -> MemorySagaStore:
    store = app.sagas.store()
    assert isinstance(store, MemorySagaStore)
    return store


async def test_a_start_message_creates_the_saga_with_its_data() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await app.send(Start("o-1", 7))
        await bus.idle()

        assert await bus.saga_data(Orders, "o-1") == OrderData("o-1", starts=[7])
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 1 and row.id == probe.saga_ids[0]
    assert bus.dead_lettered == []


async def test_events_update_the_data_and_each_save_bumps_the_revision() -> None:
    app = orders_app(Probe())
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        for n in (1, 2, 3):
            await app.send(Event("o-1", n))
            await bus.idle()
        await app.send(Note("o-1"))  # changes nothing, yet saved
        await bus.idle()

        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and data.events == [1, 2, 3]
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 5
        assert await bus.saga_data(Orders, "o-2") is None
    assert bus.dead_lettered == []


async def test_mark_complete_deletes_the_saga_and_later_messages_find_none() -> None:
    probe = Probe()
    app = orders_app(probe, Hooked)
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        await app.send(Finish("o-1"))
        await bus.idle()

        assert await bus.saga_data(Hooked, "o-1") is None
        assert await stored(app, Hooked, "o-1") is None
        assert memory_store(app).ids == {}
        await app.send(Event("o-1", 1))
        await bus.idle()
        assert probe.not_found == [Event("o-1", 1)]
        assert probe.runs["event"] == 0
        assert await bus.saga_data(Hooked, "o-1") is None
    assert bus.dead_lettered == []


async def test_not_found_is_called_for_a_message_whose_saga_does_not_exist() -> None:
    probe = Probe()
    app = orders_app(probe, Hooked)
    async with Harness(app) as bus:
        await app.send(Event("nobody", 1))
        await app.send(Finish("nobody"))
        await bus.idle()

        assert probe.not_found == [Event("nobody", 1), Finish("nobody")]
        assert probe.runs == Counter()
        assert await bus.saga_data(Hooked, "nobody") is None
    assert bus.dead_lettered == []


async def test_the_default_not_found_logs_and_acks(caplog: pytest.LogCaptureFixture) -> None:
    probe = Probe()
    app = orders_app(probe)
    caplog.set_level(logging.INFO, logger="mersal.sagas")
    async with Harness(app) as bus:
        await app.send(Event("nobody", 1))
        await bus.idle()

        assert await bus.saga_data(Orders, "nobody") is None
    assert bus.dead_lettered == []
    assert bus.retried == []
    assert probe.runs == Counter()
    assert "no Orders saga for Event: ignored" in caplog.messages


async def test_request_timeout_comes_back_to_the_saga_by_its_id() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await app.send(Start("o-1", timeout=3600))
        await bus.idle(include_delayed=False)

        [deferred] = bus.deferred
        assert deferred.message == Expired("o-1")
        assert deferred.address == QUEUE
        assert deferred.headers[Header.SAGA_ID] == probe.saga_ids[0]
        assert deferred.headers[Header.SAGA_TYPE] == SAGA
        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and not data.timed_out
        assert bus.deliver_delayed(within=60) == 0  # not due within a minute
        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["expired"] == 1
        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and data.timed_out
    assert bus.dead_lettered == []


async def test_idle_names_the_saga_timeout_it_still_waits_for() -> None:
    app = orders_app(Probe())
    async with Harness(app) as bus:
        await app.send(Start("o-1", timeout=3600))
        with pytest.raises(NotIdle) as raised:
            await bus.idle(timeout=0.2)

    assert re.fullmatch(
        r"Harness\.idle\(timeout=0\.2\): still waiting after 0\.2 s for: "
        r"a timeout of saga 'tests\.sagas\.Orders' \(Expired\) due in 359\d\.\d s",
        str(raised.value),
    ), str(raised.value)


async def test_a_timeout_after_completion_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    probe = Probe()
    app = orders_app(probe, Hooked)
    caplog.set_level(logging.INFO, logger="mersal.sagas")
    async with Harness(app) as bus:
        await app.send(Start("o-1", timeout=3600))
        await bus.idle(include_delayed=False)
        await app.send(Finish("o-1"))
        await bus.idle(include_delayed=False)
        assert await bus.saga_data(Hooked, "o-1") is None

        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["expired"] == 0
        assert probe.not_found == []  # a timeout of a completed saga is not a "not found"
        assert await bus.saga_data(Hooked, "o-1") is None
    assert bus.dead_lettered == []
    assert any("of Hooked, which has ended: ignored" in line for line in caplog.messages)


async def test_request_timeout_of_a_type_the_saga_does_not_handle_is_refused() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await app.send(Start("o-1", bad_timeout=True))
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.error_type.endswith("ConfigurationError")
        assert "add `async def ...(self, timeout: Unhandled)` to the saga" in dead.error_message
        assert await bus.saga_data(Orders, "o-1") is None
        assert bus.deferred == []


async def test_concurrent_starts_of_one_key_make_one_saga_that_every_start_ran_on() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await asyncio.gather(*(app.send(Start("o-1", n)) for n in range(20)))
        await bus.idle()

        data = await bus.saga_data(Orders, "o-1")
        assert data is not None
        assert sorted(data.starts) == list(range(20))  # every start ran on the one saga
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 20
        assert list(memory_store(app).rows) == [(SAGA, "o-1")]
        assert row.id in probe.saga_ids
    conflicts = probe.runs["start"] - 20
    print(f"memory: 20 concurrent starts, {conflicts} conflict reruns")
    assert bus.dead_lettered == []
    assert bus.retried == []


async def test_conflict_reruns_do_not_spend_the_retry_budget() -> None:
    probe = Probe()
    app = orders_app(probe, retry=RetryPolicy(immediate=0, delayed=[], error_queue=ERRORS))
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        await asyncio.gather(*(app.send(Event("o-1", n)) for n in range(50)))
        await bus.idle()

        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and sorted(data.events) == list(range(50))
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 51
    conflicts = probe.runs["event"] - 50
    print(f"memory: 50 concurrent events, {conflicts} conflict reruns")
    assert conflicts > 0, "the events did not conflict: the test proves nothing"
    assert bus.dead_lettered == []
    assert bus.retried == []


@pytest.mark.parametrize(
    "message", [Start(""), Note(""), Note(None)], ids=["start", "empty", "none"]
)
async def test_an_empty_correlation_is_dead_lettered_at_once(message: object) -> None:
    probe = Probe()
    retry = RetryPolicy(immediate=3, delayed=[10.0], error_queue=ERRORS)
    app = orders_app(probe, retry=retry)
    async with Harness(app) as bus:
        await app.send(message)
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.message == message
        assert dead.attempts == 1
        assert dead.error_type == "mersal.sagas.InvalidCorrelation"
        assert "no saga can be found by it" in dead.error_message
        assert bus.retried == []
    assert probe.runs == Counter()
    assert memory_store(app).rows == {}


async def test_the_saga_is_built_by_lagom_with_the_app_and_user_bindings() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()

    assert probe.apps == [app]  # the App itself, and the Probe bound in the Container
    assert bus.published_of(Started) == [Started("o-1")]


async def test_a_failing_method_rolls_the_data_back_and_is_retried() -> None:
    probe = Probe()
    app = orders_app(probe, retry=RetryPolicy(immediate=2, delayed=[], error_queue=ERRORS))
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        probe.failures_left = 2
        await app.send(Fail("o-1"))
        await bus.idle()

        assert probe.runs["fail"] == 3
        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and data.events == [-1]  # the failed attempts left nothing
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 2
    assert bus.dead_lettered == []


async def test_a_method_that_keeps_failing_leaves_the_data_unchanged() -> None:
    probe = Probe(failures_left=100)
    app = orders_app(probe, retry=RetryPolicy(immediate=2, delayed=[], error_queue=ERRORS))
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        await app.send(Fail("o-1"))
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.message == Fail("o-1") and dead.attempts == 3
        assert dead.error_type.endswith("Boom")
        assert probe.runs["fail"] == 3
        assert await bus.saga_data(Orders, "o-1") == OrderData("o-1", starts=[0])
        row = await stored(app, Orders, "o-1")
        assert row is not None and row.revision == 1


async def test_stored_data_that_no_longer_decodes_names_the_fix() -> None:
    app = orders_app(Probe(), retry=RetryPolicy(immediate=1, delayed=[], error_queue=ERRORS))
    async with Harness(app) as bus:
        await app.send(Start("o-1"))
        await bus.idle()
        store = memory_store(app)
        key = (SAGA, "o-1")
        store.rows[key] = replace(store.rows[key], data=b'{"order_id": 5, "starts": "x"}')
        await app.send(Event("o-1", 1))
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.attempts == 2  # retried like any failure
        assert "does not decode as OrderData" in dead.error_message
        assert "migrate the stored data, or make the class accept it" in dead.error_message


class Reminders(Saga[OrderData], name="tests.sagas.Reminders"):
    """A second saga with the same timeout type as Orders, whose not_found hook refuses."""

    started_by = (Event,)
    correlation = {Event: "order_id"}

    async def event(self, message: Event) -> None:
        self.data.events.append(message.n)

    async def expired(self, timeout: Expired) -> None:
        self.data.timed_out = True

    async def not_found(self, message: object) -> None:
        raise Boom(f"Reminders has no saga for {message!r}")


async def test_a_timeout_reaches_only_its_own_saga_when_two_sagas_share_its_type() -> None:
    """A timeout for an Orders saga is none of the Reminders saga's business.

    Its `saga-type` header names Orders, and Expired has no correlation in Reminders, so there
    is nothing for Reminders to look for: it must neither run nor call its not_found hook
    (which here raises, as the docs suggest a hook may, and would fail the timeout for both).
    """
    probe = Probe()
    app = orders_app(probe)
    app.register_saga(Reminders)
    async with Harness(app) as bus:
        await app.send(Start("o-1", timeout=3600))
        await bus.idle(include_delayed=False)
        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert bus.dead_lettered == []
        assert probe.runs["expired"] == 1
        data = await bus.saga_data(Orders, "o-1")
        assert data is not None and data.timed_out


async def test_timeouts_requested_by_racing_starts_carry_the_one_sagas_id() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await asyncio.gather(*(app.send(Start("o-1", n, timeout=3600)) for n in range(10)))
        await bus.idle(include_delayed=False)

        row = await stored(app, Orders, "o-1")
        assert row is not None
        assert len(bus.deferred) == 10  # one per committed attempt: none from a rolled-back one
        assert {d.headers[Header.SAGA_ID] for d in bus.deferred} == {row.id}
        assert bus.deliver_delayed() == 10
        await bus.idle()
        assert probe.runs["expired"] == 10
    assert bus.dead_lettered == []


async def test_an_old_timeout_does_not_reach_a_new_saga_of_the_same_correlation() -> None:
    probe = Probe()
    app = orders_app(probe)
    async with Harness(app) as bus:
        await app.send(Start("o-1", 1, timeout=3600))
        await bus.idle(include_delayed=False)
        await app.send(Finish("o-1"))
        await bus.idle(include_delayed=False)
        await app.send(Start("o-1", 2))  # a new saga, a new id, no timeout of its own
        await bus.idle(include_delayed=False)
        first, second = probe.saga_ids
        assert first != second

        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["expired"] == 0
        assert await bus.saga_data(Orders, "o-1") == OrderData("o-1", starts=[2])
    assert bus.dead_lettered == []
