"""`mersal dlq drop` end to end on RabbitMQ, and the progress of long drops and replays."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from uuid import uuid4

import aio_pika
import pytest

from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_rabbitmq import RabbitMQTransport
from tests.cli.conftest import Queues, mersal
from tests.support import eventually

pytestmark = pytest.mark.integration


class Terminal(io.StringIO):
    """A stream that says it is a terminal: what a person at the keyboard types, or sees."""

    def isatty(self) -> bool:
        """Yes, a terminal."""
        return True


def failed(message_id: str, type_name: str, error_type: str, error_message: str) -> Envelope:
    """A dead letter's envelope, as the error queue holds it."""
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: type_name,
        Header.ERROR_TYPE: error_type,
        Header.ERROR_MESSAGE: error_message,
        Header.ERROR_QUEUE: "payments",
    }
    return Envelope(headers, b'{"n": 1}')


MIXED = (
    failed("m1", "pay.Charge.v1", "pay.CardDeclined", "card declined for o-1"),
    failed("m2", "pay.Refund.v1", "mersal.errors.DecodeError", "unknown message type"),
    failed("m3", "pay.Charge.v1", "TimeoutError", "timed out after 30 s"),
    failed("m4", "pay.Charge.v1", "pay.CardDeclined", "card declined for o-4"),
)
"""Four dead letters of two types and three errors."""


@dataclass
class ErrorQueue:
    """An error queue of the test's own on RabbitMQ: filled directly, read from outside."""

    url: str
    name: str

    @property
    def options(self) -> tuple[str, ...]:
        """The command-line options naming it."""
        return ("--transport", self.url, "--queue", self.name)

    async def fill(self, envelopes: tuple[Envelope, ...] | list[Envelope]) -> None:
        """Declare the queue and put these messages in it, in order."""
        transport = RabbitMQTransport(self.url)
        await transport.start()
        try:
            await transport.declare(self.name)
            await transport.send([Outgoing(self.name, envelope) for envelope in envelopes])
        finally:
            await transport.stop()

    async def ids(self) -> list[str | None]:
        """The ids of the messages in the queue, in order; all stay there."""
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.name, passive=True)
            ids = []
            while (message := await queue.get(no_ack=False, fail=False)) is not None:
                ids.append(message.message_id)
        return ids  # unacknowledged: closing the channel put them back in their places

    async def holds(self, expected: list[str]) -> bool:
        """Whether the queue holds exactly these messages, in this order."""
        return await self.ids() == expected


@pytest.fixture
def error(amqp_url: str, queues: Queues) -> ErrorQueue:
    """An error queue no other test uses, deleted afterwards."""
    name = f"cli-{uuid4().hex[:10]}.error"
    queues.names.add(name)
    return ErrorQueue(amqp_url, name)


async def test_drop_by_id_leaves_the_others_in_their_order(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    await error.fill(MIXED)

    assert await mersal("dlq", "drop", "m2", "m4", "nope", "--yes", *error.options) == 1

    output = capsys.readouterr()
    assert output.out.splitlines() == [
        "dropped m2 (pay.Refund.v1)",
        "dropped m4 (pay.Charge.v1)",
        f"dropped 2 of 3 message(s) from {error.name!r}",
    ]
    assert output.err == f"mersal: no message 'nope' among the first 1000 in {error.name!r}\n"
    await eventually(lambda: error.holds(["m1", "m3"]), "m1 and m3 left, in order")


async def test_drop_by_type_and_error_text(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    await error.fill(MIXED)
    drop = ("dlq", "drop", "--yes", *error.options)

    assert await mersal(*drop, "--type", "pay.Charge.v1", "--error", "Declined") == 0
    assert capsys.readouterr().out.splitlines() == [
        "dropped m1 (pay.Charge.v1)",
        "dropped m4 (pay.Charge.v1)",
        f"dropped 2 of 2 message(s) from {error.name!r}",
    ]  # m3 is a Charge that failed otherwise; m2 is no Charge
    await eventually(lambda: error.holds(["m2", "m3"]), "m2 and m3 left")

    assert await mersal(*drop, "--error", "DecodeError") == 0  # in the error type
    assert capsys.readouterr().out.startswith("dropped m2 (pay.Refund.v1)\n")
    assert await mersal(*drop, "--type", "pay.Refund.v1") == 0  # none left: nothing to do
    assert capsys.readouterr().out == f"dropped 0 of 0 message(s) from {error.name!r}\n"
    await eventually(lambda: error.holds(["m3"]), "m3 left")

    assert await mersal(*drop, "--error", "timed out") == 0  # in the error message
    await eventually(lambda: error.holds([]), "the queue empty")


async def test_drop_all_takes_the_first_limit_messages_and_shows_no_progress_when_piped(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [f"m{n:02}" for n in range(80)]
    await error.fill([failed(i, "pay.Charge.v1", "E", "boom") for i in ids])

    assert await mersal("dlq", "drop", "--all", "--limit", "60", "--yes", *error.options) == 0

    output = capsys.readouterr()
    lines = output.out.splitlines()
    assert lines[:2] == ["dropped m00 (pay.Charge.v1)", "dropped m01 (pay.Charge.v1)"]
    assert lines[-1] == f"dropped 60 of 60 message(s) from {error.name!r}"
    assert len(lines) == 61
    assert output.err == ""  # stderr is no terminal here: no progress line
    await eventually(lambda: error.holds(ids[60:]), "the last 20 left, in order")


async def test_on_a_terminal_drop_lists_asks_and_shows_its_progress(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [f"m{n:02}" for n in range(60)]
    await error.fill([failed(i, "pay.Charge.v1", "pay.CardDeclined", f"no {i}") for i in ids])
    screen = Terminal()
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    monkeypatch.setattr(sys, "stderr", screen)

    assert await mersal("dlq", "drop", "--type", "pay.Charge.v1", *error.options) == 0

    shown = screen.getvalue().split("\n")  # not splitlines(): "\r" would end lines too
    assert shown[0].split() == [
        "MESSAGE-ID",
        "TYPE",
        "ERROR",
        "ATTEMPTS",
        "SOURCE",
        "FAILED-AT",
        "MESSAGE",
    ]
    assert [line.split()[0] for line in shown[1:11]] == ids[:10]
    assert shown[11] == "... and 50 more"
    question = f"drop 60 message(s) from {error.name!r}? [y/N] "
    assert shown[12].startswith(f"{question}\rdropped ")
    assert shown[12].endswith("\rdropped 60/60")
    assert shown[13:] == [""]  # the progress line ended
    assert capsys.readouterr().out.endswith(f"dropped 60 of 60 message(s) from {error.name!r}\n")
    await eventually(lambda: error.holds([]), "the queue empty")


async def test_a_no_at_the_question_drops_nothing(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await error.fill(MIXED)
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))

    assert await mersal("dlq", "drop", "m1", "m3", *error.options) == 2

    output = capsys.readouterr()
    assert [line.split()[0] for line in output.err.splitlines()[1:3]] == ["m1", "m3"]
    assert output.err.endswith(f"drop 2 message(s) from {error.name!r}? [y/N] ")
    assert output.out == f"nothing dropped from {error.name!r}\n"
    await eventually(lambda: error.holds(["m1", "m2", "m3", "m4"]), "every message left")


async def test_without_a_terminal_drop_needs_yes_and_drops_nothing(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await error.fill(MIXED)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped: no one to ask

    assert await mersal("dlq", "drop", "--all", *error.options) == 2

    assert "stdin is not a terminal: pass --yes" in capsys.readouterr().err
    await eventually(lambda: error.holds(["m1", "m2", "m3", "m4"]), "every message left")


async def test_drop_needs_one_way_of_choosing(
    error: ErrorQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    await error.fill(MIXED)
    for choice in (
        [],
        ["m1", "--all"],
        ["m1", "--type", "pay.Charge.v1"],
        ["--all", "--error", "x"],
    ):
        assert await mersal("dlq", "drop", *choice, "--yes", *error.options) == 2
        assert (
            "needs message ids, --type/--error, or --all (one of them)" in capsys.readouterr().err
        )
    await eventually(lambda: error.holds(["m1", "m2", "m3", "m4"]), "every message left")


async def test_a_long_replay_shows_its_progress_on_a_terminal_only(
    error: ErrorQueue,
    queues: Queues,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [f"m{n:02}" for n in range(120)]
    await error.fill([failed(i, "pay.Charge.v1", "E", "boom") for i in ids])
    parking = ErrorQueue(error.url, f"{error.name}.parking")
    queues.names.add(parking.name)
    await parking.fill([])
    replay = ("dlq", "replay", "--all", "--to", parking.name, *error.options)

    assert await mersal(*replay, "--limit", "60") == 0
    assert capsys.readouterr().err == ""

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert await mersal(*replay) == 0
    updates = screen.getvalue().split("\r")[1:]
    assert updates[0].startswith("replayed ") and updates[-1] == "replayed 60/60\n"
    await eventually(lambda: parking.holds(ids), "every message in the other queue, in order")
    await eventually(lambda: error.holds([]), "the error queue empty")
