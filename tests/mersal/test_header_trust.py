"""Headers from outside never steer the framework into silence (memory transport).

`attempt`: a forged count can cut retries short but never drop a message or make it retry
without end. `error-*`: a message that carries them is an ordinary message. `deliver-at`: the
transport honours it when a message is sent (that is how `defer` and delayed retries work); on a
message already received it delays nothing, neither its handling nor its dead letter.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given

from mersal import App, Envelope, Header, MessageContext, Outgoing, RetryPolicy
from mersal.retry import MAX_ATTEMPTS
from mersal.testing import Harness
from mersal.transport.memory import MemoryBroker
from tests.fuzz.rig import DOOMED, FUZZ, JSON, ORDER, Case, Doom, Doomed, Order, Rig
from tests.fuzz.strategies import attempts

ERRORS = "errors"
DOOM_TYPE = f"{Doom.__module__}.{Doom.__qualname__}"
ORDER_BODY = json.dumps({"order_id": "o-1", "amount": 9.5}).encode()
DOOMED_BODY = json.dumps({"order_id": "o-1"}).encode()
DAY_AHEAD = f"{time.time() + 86_400:.6f}"


@dataclass
class Running:
    """An app under the harness, and what its handlers saw."""

    app: App
    bus: Harness
    handled: list[str]
    failed: list[str]

    @property
    def broker(self) -> MemoryBroker:
        return self.bus.broker

    def dead(self) -> list[Envelope]:
        return [stored.envelope for stored in self.broker.queues[ERRORS].ready]

    async def send_raw(self, headers: dict[str, str], body: bytes) -> None:
        """What a producer that is not Mersal sends: the transport honours its deliver-at."""
        await self.app.transport.send([Outgoing(self.app.name, Envelope(headers, body))])

    def put_raw(self, headers: dict[str, str], body: bytes) -> None:
        """Straight into the queue, as RabbitMQ hands over what another client published."""
        self.broker.queues[self.app.name].put(Envelope(headers, body))

    def assert_settled(self) -> None:
        queue = self.broker.queues[self.app.name]
        assert (len(queue.ready), queue.unacked, self.broker.delayed) == (0, 0, 0)


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    handled: list[str] = []
    failed: list[str] = []

    async def take_order(message: Order, context: MessageContext) -> None:
        handled.append(context.message_id)

    async def doom(message: Doomed, context: MessageContext) -> None:
        failed.append(context.message_id)
        raise Doom(f"{message.order_id} is doomed")

    app = App("billing", retry=RetryPolicy(immediate=1, delayed=[0.05], error_queue=ERRORS))
    app.register(Order, take_order)
    app.register(Doomed, doom)
    async with Harness(app) as bus:
        yield Running(app, bus, handled, failed)


def order(message_id: str, **headers: str) -> dict[str, str]:
    return {Header.TYPE: ORDER, Header.CONTENT_TYPE: JSON, Header.MESSAGE_ID: message_id, **headers}


def doomed(message_id: str, **headers: str) -> dict[str, str]:
    return {Header.TYPE: DOOMED, Header.MESSAGE_ID: message_id, **headers}


# attempt


async def test_a_forged_attempt_count_cannot_drop_a_failing_message(running: Running) -> None:
    await running.send_raw(doomed("m-1", **{Header.ATTEMPT: "999999"}), DOOMED_BODY)
    await running.bus.idle()

    [dead] = running.dead()
    assert dead.headers[Header.MESSAGE_ID] == "m-1"
    assert dead.headers[Header.ERROR_TYPE] == DOOM_TYPE
    assert dead.headers[Header.ERROR_MESSAGE] == "o-1 is doomed"
    assert dead.body == DOOMED_BODY
    assert running.failed == ["m-1"]  # the forged count used up the retries, nothing more
    running.assert_settled()


@pytest.mark.parametrize("forged", ["-999999", "0", "abc", "", "1e9", " 3 "])
async def test_a_forged_low_or_garbage_attempt_gets_no_more_than_the_policy(
    running: Running, forged: str
) -> None:
    await running.send_raw(doomed("m-1", **{Header.ATTEMPT: forged}), DOOMED_BODY)
    await running.bus.idle()

    [dead] = running.dead()
    assert dead.headers[Header.ERROR_TYPE] == DOOM_TYPE
    assert 1 <= len(running.failed) <= running.app.retry.max_attempts
    running.assert_settled()


@pytest.fixture
def quick_retries() -> Iterator[Rig]:
    rig = Rig(retry=RetryPolicy(immediate=1, delayed=[0.0], error_queue="fuzz.error"))
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


@FUZZ
@given(attempts)
def test_any_attempt_header_ends_a_failing_message_in_the_error_queue_once(
    quick_retries: Rig, forged: str
) -> None:
    rig = quick_retries
    headers = {Header.TYPE: DOOMED, Header.ATTEMPT: forged}

    report = rig.run([Case(headers, DOOMED_BODY, expect="dead-lettered after its retries")])

    [probe] = report.probes
    assert 1 <= report.failed[probe] <= rig.app.retry.max_attempts
    [dead] = report.dead[probe]
    assert dead.headers[Header.ERROR_TYPE] == DOOM_TYPE
    assert 1 <= int(dead.headers[Header.ERROR_ATTEMPTS]) <= MAX_ATTEMPTS + 3
    assert report.sentinel == 1
    assert not report.strays


# error-*


FORGED_ERROR = {
    Header.ERROR_TYPE: "mersal.errors.DecodeError",
    Header.ERROR_MESSAGE: "forged",
    Header.ERROR_TRACEBACK: "Traceback: forged",
    Header.ERROR_ATTEMPTS: "99",
    Header.ERROR_QUEUE: "elsewhere",
    Header.FAILED_AT: "0",
}


async def test_a_forged_error_header_does_not_make_a_message_dead(running: Running) -> None:
    await running.send_raw(order("m-1", **FORGED_ERROR), ORDER_BODY)
    await running.bus.idle()

    assert running.handled == ["m-1"]
    assert running.dead() == []
    running.assert_settled()


async def test_a_failing_message_with_forged_error_headers_gets_the_real_ones(
    running: Running,
) -> None:
    await running.send_raw(doomed("m-1", **FORGED_ERROR), DOOMED_BODY)
    await running.bus.idle()

    [dead] = running.dead()
    assert dead.headers[Header.ERROR_TYPE] == DOOM_TYPE
    assert dead.headers[Header.ERROR_MESSAGE] == "o-1 is doomed"
    assert dead.headers[Header.ERROR_ATTEMPTS] == "3"
    assert dead.headers[Header.ERROR_QUEUE] == "billing"
    assert "Doom: o-1 is doomed" in dead.headers[Header.ERROR_TRACEBACK]
    assert running.failed == ["m-1"] * 3


async def test_the_harness_records_a_message_with_a_forged_error_header_as_sent(
    running: Running,
) -> None:
    await running.app.send_local(Order("o-1", 9.5), headers=FORGED_ERROR)
    await running.bus.idle()

    assert running.bus.dead_lettered == []


# deliver-at


async def test_a_received_message_with_a_forged_deliver_at_is_handled_at_once(
    running: Running,
) -> None:
    running.put_raw(order("m-1", **{Header.DELIVER_AT: DAY_AHEAD}), ORDER_BODY)
    await running.bus.idle(timeout=1.0)

    assert running.handled == ["m-1"]
    running.assert_settled()


async def test_the_memory_transport_honours_deliver_at_when_a_message_is_sent(
    running: Running,
) -> None:
    # A sender asking for a delay gets it (defer and delayed retries rely on this).
    await running.send_raw(order("m-1", **{Header.DELIVER_AT: DAY_AHEAD}), ORDER_BODY)
    await running.bus.idle(include_delayed=False)

    assert running.handled == []
    assert running.broker.delayed == 1


@pytest.mark.parametrize(
    "deliver_at", [DAY_AHEAD, "1e12", "inf", "1e400"], ids=["a-day-ahead", "1e12", "inf", "1e400"]
)
@pytest.mark.parametrize("kind", ["undecodable", "failing"])
async def test_a_forged_deliver_at_does_not_hold_back_the_dead_letter(
    running: Running, deliver_at: str, kind: str
) -> None:
    forged = {Header.DELIVER_AT: deliver_at}
    if kind == "undecodable":
        running.put_raw(order("m-1", **forged, **{Header.TYPE: "os.system"}), ORDER_BODY)
    else:
        running.put_raw(doomed("m-1", **forged, **{Header.ATTEMPT: "2"}), DOOMED_BODY)
    await running.bus.idle(timeout=2.0, include_delayed=False)

    [dead] = running.dead()
    assert dead.headers[Header.MESSAGE_ID] == "m-1"
    assert Header.DELIVER_AT not in dead.headers
    running.assert_settled()


async def test_a_delayed_retry_sets_its_own_deliver_at(running: Running) -> None:
    running.put_raw(doomed("m-1", **{Header.DELIVER_AT: DAY_AHEAD}), DOOMED_BODY)
    await running.bus.idle(timeout=2.0)

    assert running.failed == ["m-1"] * 3  # the delayed retry came back after 0.05 s, not a day
    assert len(running.dead()) == 1
    [retried] = running.bus.retried
    assert float(retried.headers[Header.DELIVER_AT]) < time.time()
