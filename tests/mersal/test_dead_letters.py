"""`mersal.dead_letters` on the memory transport: look at an error queue, replay and drop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from mersal import App, Header, MessageContext, RetryPolicy, message
from mersal.dead_letters import (
    DeadLetter,
    DeadLetters,
    MissingQueue,
    body_text,
    details,
    replayable,
    summary,
)
from mersal.errors import ConfigurationError
from mersal.messages import Envelope
from mersal.text import first_line
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryQueue, MemoryTransport
from tests.support import eventually

IDLE = 0.1


@message("tests.dead_letters.Charge.v1")
@dataclass
class Charge:
    """A command that fails while the card service is broken."""

    order_id: str


class CardDeclined(Exception):
    """The handler's failure, on purpose."""


@dataclass
class Payments:
    """The payments app and what its handler saw."""

    app: App
    broken: bool = True
    handled: list[tuple[str, int, dict[str, str]]] = field(default_factory=list)

    async def charge(self, command: Charge, context: MessageContext) -> None:
        """Fail while broken; record the message otherwise."""
        if self.broken:
            raise CardDeclined(f"card declined for {command.order_id}\nsecond line")
        self.handled.append((command.order_id, context.attempt, dict(context.headers)))


@pytest.fixture
async def payments(memory_url: str) -> AsyncIterator[Payments]:
    """A running payments app whose failures go straight to the "error" queue."""
    app = App("payments", transport=memory_url, retry=RetryPolicy(immediate=0, delayed=[]))
    payments = Payments(app)
    app.register(Charge, payments.charge)
    app.route(Charge, "payments")
    async with app:
        yield payments


@pytest.fixture
async def transport(memory_url: str) -> AsyncIterator[MemoryTransport]:
    """An operator's transport on the app's memory broker."""
    transport = MemoryTransport(memory_url)
    await transport.start()
    try:
        yield transport
    finally:
        await transport.stop()


def error_queue(transport: MemoryTransport) -> MemoryQueue:
    """The memory broker's "error" queue."""
    return transport.broker.queues["error"]


def ids_in(queue: MemoryQueue) -> list[str | None]:
    """The ids of the messages ready in `queue`, in order."""
    return [stored.envelope.message_id for stored in queue.ready]


async def dead_letter(payments: Payments, transport: MemoryTransport, *order_ids: str) -> list[str]:
    """Send Charge commands that fail; returns their ids once all are in the error queue."""
    ids = [await payments.app.send(Charge(order_id)) for order_id in order_ids]
    await eventually(lambda: len(error_queue(transport)) == len(ids), "the dead letters")
    return ids


async def test_peek_shows_why_messages_failed_and_leaves_them_in_place(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1", "o-2")

    letters = await DeadLetters(transport, idle=IDLE).peek()

    assert [letter.message_id for letter in letters] == ids
    first = letters[0]
    assert first.type_name == "tests.dead_letters.Charge.v1"
    assert first.error_type == f"{__name__}.CardDeclined"
    assert first.error_message == "card declined for o-1\nsecond line"
    assert first.attempts == 1
    assert first.source_queue == "payments"
    assert first.failed_at is not None and abs(first.failed_at.timestamp() - time.time()) < 60
    cells = summary(first)
    assert cells[:5] == (
        ids[0],
        "tests.dead_letters.Charge.v1",
        f"{__name__}.CardDeclined",
        "1",
        "payments",
    )
    assert cells[6] == "card declined for o-1"
    queue = error_queue(transport)
    assert ids_in(queue) == ids  # all back, in their order
    assert queue.unacked == 0


async def test_peek_takes_at_most_the_limit_and_an_empty_queue_ends_after_the_idle_time(
    payments: Payments, transport: MemoryTransport
) -> None:
    dead_letters = DeadLetters(transport, idle=IDLE)
    started = time.monotonic()
    assert await dead_letters.peek() == []
    assert time.monotonic() - started < 2

    ids = await dead_letter(payments, transport, "o-1", "o-2", "o-3")
    assert [letter.message_id for letter in await dead_letters.peek(2)] == ids[:2]
    assert ids_in(error_queue(transport)) == ids


async def test_find_and_describe_show_every_header_and_the_body(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1", "o-2")

    [letter] = await DeadLetters(transport, idle=IDLE).find({ids[1]})

    text = details(letter)
    assert f"  {Header.MESSAGE_ID}: {ids[1]}" in text
    assert f"  {Header.ERROR_TYPE}: {__name__}.CardDeclined" in text
    assert f"  {Header.ERROR_MESSAGE}: card declined for o-2\n      second line" in text
    assert f"  {Header.ERROR_QUEUE}: payments" in text
    assert "Traceback (most recent call last)" in text
    assert f"  {Header.FAILED_AT}: " in text and "Z)" in text  # the epoch time, and as ISO
    assert text.endswith('{\n  "order_id": "o-2"\n}')
    assert ids_in(error_queue(transport)) == ids


async def test_replay_sends_the_message_back_with_fresh_retries_and_removes_it(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1", "o-2")
    payments.broken = False

    [replay] = await DeadLetters(transport, idle=IDLE).replay({ids[0]})

    assert replay.done and replay.queue == "payments"
    await eventually(lambda: bool(payments.handled), "the replayed message handled")
    order_id, attempt, headers = payments.handled[0]
    assert (order_id, attempt) == ("o-1", 1)
    assert headers[Header.MESSAGE_ID] == ids[0]  # the same message, by its id
    assert not {Header.ERROR_TYPE, Header.ERROR_QUEUE, Header.ATTEMPT} & set(headers)
    assert ids_in(error_queue(transport)) == [ids[1]]  # the other one stays


async def test_replay_all_and_to_another_queue(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1", "o-2")
    await transport.declare("parking")

    replays = await DeadLetters(transport, idle=IDLE).replay(to="parking")

    assert [(r.letter.message_id, r.queue, r.done) for r in replays] == [
        (ids[0], "parking", True),
        (ids[1], "parking", True),
    ]
    assert ids_in(transport.broker.queues["parking"]) == ids
    assert len(error_queue(transport)) == 0


async def test_a_message_that_cannot_be_replayed_stays_in_the_error_queue(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1")
    no_source = Envelope({Header.MESSAGE_ID: "foreign", Header.TYPE: "x.Y"}, b"\xff")
    await transport.send([Outgoing("error", no_source)])
    dead_letters = DeadLetters(transport, idle=IDLE)

    replays = await dead_letters.replay(to="nowhere")
    assert [(r.sent, r.problem is not None) for r in replays] == [(False, True), (False, True)]
    assert replays[0].problem is not None and "Unroutable" in replays[0].problem

    [foreign] = await dead_letters.replay({"foreign"})
    assert foreign.problem == "it has no error-source-queue header: name the queue to replay it to"
    [itself] = await dead_letters.replay({"foreign"}, to="error")
    assert itself.problem == "that is the error queue itself"
    assert ids_in(error_queue(transport)) == [ids[0], "foreign"]


async def test_what_was_taken_goes_back_when_the_caller_fails(
    payments: Payments, transport: MemoryTransport
) -> None:
    ids = await dead_letter(payments, transport, "o-1", "o-2")
    with pytest.raises(RuntimeError):
        async with DeadLetters(transport, idle=IDLE).take(10) as held:
            assert len(held) == 2
            await held[0].ack()
            raise RuntimeError("the operator's script fails")
    assert ids_in(error_queue(transport)) == [ids[1]]
    assert error_queue(transport).unacked == 0


def test_replayable_drops_the_error_and_retry_headers_only() -> None:
    headers = {
        Header.MESSAGE_ID: "m-1",
        Header.TYPE: "t",
        Header.CORRELATION_ID: "c-1",
        Header.ATTEMPT: "3",
        Header.DELIVER_AT: "1700000000.0",
        Header.ERROR_TYPE: "E",
        Header.ERROR_MESSAGE: "m",
        Header.ERROR_TRACEBACK: "tb",
        Header.ERROR_ATTEMPTS: "3",
        Header.ERROR_QUEUE: "q",
        Header.FAILED_AT: "1700000000.0",
        "x-tenant": "acme",
    }
    replayed = replayable(Envelope(headers, b"{}"))
    assert replayed.headers == {
        Header.MESSAGE_ID: "m-1",
        Header.TYPE: "t",
        Header.CORRELATION_ID: "c-1",
        "x-tenant": "acme",
        Header.REPLAYS: "1",
    }
    assert replayed.body == b"{}"
    assert replayable(replayed).headers[Header.REPLAYS] == "2"  # each replay a new attempt


def test_odd_dead_letters_are_still_shown() -> None:
    letter = DeadLetter(Envelope({Header.ERROR_ATTEMPTS: "many", Header.FAILED_AT: "soon"}, b""))
    assert letter.attempts is None and letter.failed_at is None
    assert summary(letter) == ("-", "-", "-", "-", "-", "-", "-")
    assert body_text(b"\xff\x00") == repr(b"\xff\x00")
    assert body_text(b"not json") == repr(b"not json")
    assert first_line("  \n  a   b\nc", 80) == "a b"
    assert first_line("x" * 100, 10) == "xxxxxxx..."


def test_the_queue_name_and_the_idle_time_are_checked() -> None:
    with pytest.raises(ConfigurationError):
        DeadLetters(MemoryTransport(), "")
    with pytest.raises(ConfigurationError):
        DeadLetters(MemoryTransport(), idle=0)


async def test_a_limit_out_of_range_is_refused(transport: MemoryTransport) -> None:
    for limit in (0, 65_536):
        with pytest.raises(ConfigurationError, match="limit"):
            await DeadLetters(transport).peek(limit)


def failed(message_id: str, type_name: str, error_type: str, error_message: str) -> Outgoing:
    """A dead letter as the error queue holds it, put there directly."""
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: type_name,
        Header.ERROR_TYPE: error_type,
        Header.ERROR_MESSAGE: error_message,
        Header.ERROR_QUEUE: "payments",
    }
    return Outgoing("error", Envelope(headers, b"{}"))


@pytest.fixture
async def mixed(transport: MemoryTransport) -> DeadLetters:
    """An error queue of four dead letters of two types and three errors."""
    await transport.declare("error")
    await transport.send(
        [
            failed("m1", "pay.Charge.v1", "pay.CardDeclined", "card declined for o-1"),
            failed("m2", "pay.Refund.v1", "mersal.errors.DecodeError", "unknown message type"),
            failed("m3", "pay.Charge.v1", "TimeoutError", "timed out after 30 s"),
            failed("m4", "pay.Charge.v1", "pay.CardDeclined", "card declined for o-4"),
        ]
    )
    return DeadLetters(transport, idle=IDLE)


async def test_drop_by_id_removes_those_and_leaves_the_others_in_order(
    mixed: DeadLetters, transport: MemoryTransport
) -> None:
    drops = await mixed.drop({"m2", "m4", "nope"})

    assert [(drop.letter.message_id, drop.done) for drop in drops] == [("m2", True), ("m4", True)]
    assert ids_in(error_queue(transport)) == ["m1", "m3"]
    assert error_queue(transport).unacked == 0


async def test_drop_by_type_and_error_text_both_must_match(
    mixed: DeadLetters, transport: MemoryTransport
) -> None:
    drops = await mixed.drop(type_name="pay.Charge.v1", error="Declined")
    assert [drop.letter.message_id for drop in drops] == ["m1", "m4"]  # m3: no; m2: other type
    assert ids_in(error_queue(transport)) == ["m2", "m3"]

    [by_type] = await mixed.drop(error="DecodeError")  # in the error type
    [by_message] = await mixed.drop(error="timed out")  # in the error message
    assert (by_type.letter.message_id, by_message.letter.message_id) == ("m2", "m3")
    assert ids_in(error_queue(transport)) == []


async def test_drop_with_nothing_chosen_drops_every_message_up_to_the_limit(
    mixed: DeadLetters, transport: MemoryTransport
) -> None:
    assert [drop.letter.message_id for drop in await mixed.drop(limit=3)] == ["m1", "m2", "m3"]
    assert ids_in(error_queue(transport)) == ["m4"]


async def test_drop_asks_first_and_a_no_drops_nothing(
    mixed: DeadLetters, transport: MemoryTransport
) -> None:
    asked: list[list[str | None]] = []

    async def refuse(letters: Sequence[DeadLetter]) -> bool:
        asked.append([letter.message_id for letter in letters])
        return False

    assert await mixed.drop(type_name="pay.Charge.v1", confirm=refuse) == []
    assert asked == [["m1", "m3", "m4"]]
    assert ids_in(error_queue(transport)) == ["m1", "m2", "m3", "m4"]

    assert await mixed.drop({"nope"}, confirm=refuse) == []
    assert len(asked) == 1  # nothing chosen: nothing to ask about


async def test_replay_and_drop_tell_their_progress(
    mixed: DeadLetters, transport: MemoryTransport
) -> None:
    await transport.declare("parking")
    told: list[tuple[int, int]] = []

    await mixed.replay({"m1", "m2"}, to="parking", progress=lambda *step: told.append(step))
    await mixed.drop(progress=lambda *step: told.append(step))

    assert told == [(1, 2), (2, 2), (1, 2), (2, 2)]
    assert ids_in(transport.broker.queues["parking"]) == ["m1", "m2"]


async def test_a_missing_error_queue_is_named(transport: MemoryTransport) -> None:
    with pytest.raises(MissingQueue, match="no queue named 'errors'") as raised:
        await DeadLetters(transport, "errors", idle=IDLE).drop()
    assert raised.value.queue == "errors"
