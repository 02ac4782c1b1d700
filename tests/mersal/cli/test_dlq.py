"""`mersal dlq list|show|replay|drop` end to end on RabbitMQ, run in-process as `main([...])`."""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from uuid import uuid4

import aio_pika
import pytest

from mersal import App, Header, MessageContext, RetryPolicy, message
from mersal.messages import Envelope
from mersal.transport import Outgoing
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.management import Management
from tests.support import Broker, Terminal, eventually, mersal, queue_types, rabbitmqctl

pytestmark = pytest.mark.integration


@message("tests.dlq.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    """A command that fails while the orders service is broken."""

    order_id: str


class OutOfStock(Exception):
    """The handler's failure, on purpose."""


@dataclass
class Orders:
    """The orders app on RabbitMQ and what its handler saw."""

    app: App
    error_queue: str
    broken: bool = True
    handled: list[tuple[str, int, dict[str, str]]] = field(default_factory=list)

    async def place(self, command: PlaceOrder, context: MessageContext) -> None:
        """Fail while broken; record the message otherwise."""
        if self.broken:
            raise OutOfStock(f"no stock for {command.order_id}")
        self.handled.append((command.order_id, context.attempt, dict(context.headers)))


def orders_app(url: str, broker: Broker) -> Orders:
    """The orders app: one attempt, then its own error queue (both deleted after the test)."""
    prefix = f"cli-{uuid4().hex[:10]}"
    error_queue = f"{prefix}.error"
    app = App(
        f"{prefix}.orders",
        transport=url,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=error_queue),
    )
    broker.to_delete.update({app.name, error_queue})
    orders = Orders(app, error_queue)
    app.register(PlaceOrder, orders.place)
    app.route(PlaceOrder, app.name)
    return orders


async def count_is(broker: Broker, queue: str, expected: int) -> bool:
    """Whether `queue` holds `expected` ready messages."""
    return await broker.count(queue) == expected


async def test_list_show_and_replay_a_failed_message(
    amqp_url: str, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, broker)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    async with app:
        message_id = await app.send(PlaceOrder("o-1"))
        await eventually(lambda: count_is(broker, error, 1), "the message in the error queue")

        assert await mersal("dlq", "list", *options) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == [
            "MESSAGE-ID",
            "TYPE",
            "ERROR",
            "ATTEMPTS",
            "SOURCE",
            "FAILED-AT",
            "MESSAGE",
        ]
        cells = lines[1].split(maxsplit=6)
        assert cells[:5] == [
            message_id,
            "tests.dlq.PlaceOrder.v1",
            f"{__name__}.OutOfStock",
            "1",
            app.name,
        ]
        assert cells[5].endswith("Z") and cells[6] == "no stock for o-1"
        assert lines[2] == f"1 message(s) in {error!r}, all left there"
        await eventually(lambda: count_is(broker, error, 1), "the message back in the error queue")

        assert await mersal("dlq", "show", message_id, *options) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"message {message_id} in {error!r}:\nheaders:\n")
        assert f"  {Header.ERROR_TYPE}: {__name__}.OutOfStock\n" in shown
        assert f"  {Header.ERROR_MESSAGE}: no stock for o-1\n" in shown
        assert f"  {Header.ERROR_ATTEMPTS}: 1\n" in shown
        assert f"  {Header.ERROR_QUEUE}: {app.name}\n" in shown
        assert f"  {Header.ERROR_TRACEBACK}: Traceback (most recent call last):" in shown
        assert shown.endswith('{\n  "order_id": "o-1"\n}\n')
        await eventually(lambda: count_is(broker, error, 1), "the message still in the error queue")

        orders.broken = False
        assert await mersal("dlq", "replay", message_id, *options) == 0
        out = capsys.readouterr().out
        assert f"replayed {message_id} (tests.dlq.PlaceOrder.v1) to {app.name!r}" in out
        assert out.endswith(f"replayed 1 of 1 message(s) from {error!r}\n")
        await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
        await eventually(lambda: count_is(broker, error, 0), "the error queue empty")

    order_id, attempt, headers = orders.handled[0]
    assert (order_id, attempt) == ("o-1", 1)  # a fresh set of retries
    assert headers[Header.MESSAGE_ID] == message_id
    assert not {Header.ERROR_TYPE, Header.ERROR_QUEUE, Header.ATTEMPT} & set(headers)


async def test_replay_all_to_another_queue_and_what_cannot_be_found(
    amqp_url: str, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, broker)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    elsewhere = f"{app.name}.elsewhere"
    broker.to_delete.add(elsewhere)
    async with app:
        ids = [await app.send(PlaceOrder(f"o-{n}")) for n in (1, 2)]
        await eventually(lambda: count_is(broker, error, 2), "both messages in the error queue")
        await app.transport.declare(elsewhere)

        assert await mersal("dlq", "replay", ids[0], "no-such-id", "--to", elsewhere, *options) == 1
        output = capsys.readouterr()
        assert f"replayed {ids[0]} (tests.dlq.PlaceOrder.v1) to {elsewhere!r}" in output.out
        assert "no message 'no-such-id'" in output.err
        await eventually(lambda: count_is(broker, elsewhere, 1), "the message in the other queue")
        await eventually(lambda: count_is(broker, error, 1), "the other message left in error")

        assert await mersal("dlq", "replay", "--all", "--to", f"{app.name}.nowhere", *options) == 1
        assert "Unroutable" in capsys.readouterr().err
        await eventually(lambda: count_is(broker, error, 1), "the unroutable one still in error")

        assert await mersal("dlq", "show", "no-such-id", *options) == 1
        assert "no message 'no-such-id'" in capsys.readouterr().err


async def test_the_commands_explain_what_they_need(
    amqp_url: str,
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)
    assert await mersal("dlq", "list") == 2
    assert "needs --transport URL or MERSAL_TRANSPORT" in capsys.readouterr().err

    assert await mersal("dlq", "list", "--transport", "memory://") == 2
    assert "in-process broker" in capsys.readouterr().err

    missing = f"cli-{uuid4().hex[:10]}.error"
    monkeypatch.setenv("MERSAL_TRANSPORT", amqp_url)
    assert await mersal("dlq", "list", "--queue", missing) == 2
    assert f"no queue named {missing!r} (from --queue) on " in capsys.readouterr().err

    assert await mersal("dlq", "replay", "--queue", missing) == 2
    assert "message ids or --all" in capsys.readouterr().err

    wrong = amqp_url.replace("guest:guest@", "guest:s3cret-pw@")
    assert await mersal("dlq", "list", "--transport", wrong) == 2
    error = capsys.readouterr().err
    assert "refused the login for user 'guest': check the user name and password" in error
    assert "s3cret-pw" not in error and "guest:***@" in error


APP_TARGET = f"{__name__}:ORDERS"
"""`--app` for the app a test puts in this module's ORDERS."""


@pytest.fixture
def no_transport_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MERSAL_TRANSPORT: the broker comes from --app or --transport."""
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)


async def test_with_app_every_command_uses_its_error_queue_and_broker(
    amqp_url: str,
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_transport_in_environment: None,
) -> None:
    orders = orders_app(amqp_url, broker)
    app, error = orders.app, orders.error_queue
    monkeypatch.setattr(sys.modules[__name__], "ORDERS", app, raising=False)
    async with app:
        ids = [await app.send(PlaceOrder(f"o-{n}")) for n in (1, 2)]
        await eventually(lambda: count_is(broker, error, 2), "both messages in the error queue")

        assert await mersal("dlq", "list", "--app", APP_TARGET) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines[1:3]] == ids
        assert lines[3] == f"2 message(s) in {error!r}, all left there"

        assert await mersal("dlq", "show", ids[1], "--app", APP_TARGET) == 0
        assert capsys.readouterr().out.startswith(f"message {ids[1]} in {error!r}:\n")

        assert await mersal("dlq", "drop", ids[1], "--yes", "--app", APP_TARGET) == 0
        assert capsys.readouterr().out.endswith(f"dropped 1 of 1 message(s) from {error!r}\n")
        await eventually(lambda: count_is(broker, error, 1), "one message dropped")

        orders.broken = False
        assert await mersal("dlq", "replay", ids[0], "--app", APP_TARGET) == 0
        assert f"replayed {ids[0]} (tests.dlq.PlaceOrder.v1) to {app.name!r}" in (
            capsys.readouterr().out
        )
        await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
        await eventually(lambda: count_is(broker, error, 0), "the error queue empty")
    assert [order_id for order_id, _, _ in orders.handled] == ["o-1"]  # o-2 was dropped


async def test_an_explicit_transport_and_queue_win_over_the_app(
    amqp_url: str,
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_transport_in_environment: None,
) -> None:
    orders = orders_app(amqp_url, broker)
    app, error = orders.app, orders.error_queue
    async with app:
        message_id = await app.send(PlaceOrder("o-1"))
        await eventually(lambda: count_is(broker, error, 1), "the message in the error queue")
    elsewhere = App(
        "elsewhere",
        transport=f"memory://cli-{uuid4().hex}",
        retry=RetryPolicy(error_queue=f"{app.name}.not-here"),
    )
    monkeypatch.setattr(sys.modules[__name__], "ORDERS", elsewhere, raising=False)

    assert await mersal("dlq", "list", "--app", APP_TARGET) == 2
    assert "app 'elsewhere' is on memory://cli-" in capsys.readouterr().err

    assert await mersal("dlq", "list", "--app", APP_TARGET, "--transport", amqp_url) == 2
    refused = capsys.readouterr().err
    assert refused.startswith(
        f"mersal: no queue named '{app.name}.not-here' (the error queue of app 'elsewhere') on "
        "amqp://guest:***@"
    )
    assert "--queue NAME" in refused and "--app module:app" in refused

    options = ("--app", APP_TARGET, "--transport", amqp_url, "--queue", error)
    assert await mersal("dlq", "list", *options) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == message_id
    assert lines[2] == f"1 message(s) in {error!r}, all left there"


async def test_a_missing_default_error_queue_points_to_queue_and_app(
    own_vhost: str, capsys: pytest.CaptureFixture[str], no_transport_in_environment: None
) -> None:
    assert await mersal("dlq", "list", "--transport", own_vhost) == 2
    assert capsys.readouterr().err == (
        f"mersal: no queue named 'error' (the default) on {own_vhost.replace(':guest@', ':***@')}"
        ": name the error queue with --queue NAME, or the app whose error queue to read with "
        "--app module:app\n"
    )

    assert await mersal("dlq", "list", "--app", "tests.no_such_module:app") == 2
    assert "cannot import 'tests.no_such_module'" in capsys.readouterr().err


@contextmanager
def delivery_limit_policy(vhost: str, queue: str, limit: int) -> Iterator[str]:
    """A policy `delivery-limit: limit` on `queue`, cleared afterwards; its name."""
    name = f"limit-{uuid4().hex[:8]}"
    definition = json.dumps({"delivery-limit": limit})
    pattern = f"^{re.escape(queue)}$"
    rabbitmqctl("set_policy", "-p", vhost, name, pattern, definition, "--apply-to", "queues")
    try:
        yield name
    finally:
        rabbitmqctl("clear_policy", "-p", vhost, name)


async def policy_is(url: str, queue: str, policy: str | None) -> bool:
    """Whether the management API says `queue` is under `policy` (None: under none)."""
    info = await Management.of(url).queue(queue)
    return info is not None and info.get("policy") == policy


async def looked_at_five_times(
    options: Sequence[str], ids: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`dlq list`, `show` and a replay and a drop that choose nothing, five times over.

    The handlers fail side by side, so the error queue's order is the order they failed in;
    each look must list every message, in the order the first look found.
    """
    first: list[str] | None = None
    for _ in range(5):
        assert await mersal("dlq", "list", *options) == 0
        listed = capsys.readouterr().out.splitlines()
        order = [line.split()[0] for line in listed[1:-1]]
        first = first or order
        assert sorted(order) == sorted(ids)
        assert order == first
        assert await mersal("dlq", "show", ids[-1], *options) == 0
        assert await mersal("dlq", "replay", "not-one-of-them", *options) == 1
        assert await mersal("dlq", "drop", "not-one-of-them", "--yes", *options) == 1
        capsys.readouterr()


async def test_the_error_queue_is_classic_and_looking_at_it_under_a_delivery_limit_keeps_all(
    amqp_url: str, vhost: str, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, broker)  # quorum queues: the transport's default
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    with delivery_limit_policy(vhost, error, 1):  # what a quorum queue would drop by at once
        async with app:
            ids = [await app.send(PlaceOrder(f"o-{n}")) for n in range(3)]
            await eventually(lambda: count_is(broker, error, 3), "three dead letters")
            types = await queue_types(vhost)
            assert (types[app.name], types[error]) == ("quorum", "classic")

            await looked_at_five_times(options, ids, capsys)
            await eventually(lambda: count_is(broker, error, 3), "every dead letter still there")

            orders.broken = False
            assert await mersal("dlq", "replay", ids[0], *options) == 0
            assert await mersal("dlq", "drop", ids[1], "--yes", *options) == 0
            await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
            await eventually(lambda: count_is(broker, error, 1), "the one left alone still there")
    assert [order_id for order_id, _, _ in orders.handled] == ["o-0"]


async def test_a_quorum_error_queue_is_used_as_it_is_and_not_looked_at_under_a_delivery_limit(
    amqp_url: str,
    vhost: str,
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    orders = orders_app(amqp_url, broker)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    async with await aio_pika.connect(amqp_url) as connection:  # left by an earlier release
        channel = await connection.channel()
        await channel.declare_queue(error, durable=True, arguments={"x-queue-type": "quorum"})
    with delivery_limit_policy(vhost, error, 3) as policy:
        async with app:  # accepted as it is, with a word on what it means
            ids = [await app.send(PlaceOrder(f"o-{n}")) for n in range(2)]
            await eventually(lambda: count_is(broker, error, 2), "two dead letters")
        assert (await queue_types(vhost))[error] == "quorum"
        assert f"error queue {error!r} is a quorum queue" in caplog.text
        await eventually(
            lambda: policy_is(amqp_url, error, policy), "the policy applied", timeout=15
        )

        for command in (("list",), ("show", ids[0]), ("replay", ids[0]), ("drop", "x", "--yes")):
            for _ in range(5):
                assert await mersal("dlq", *command, *options) == 2
                refused = capsys.readouterr().err
                assert refused.startswith(
                    f"mersal: will not take messages from {error!r}: it is a quorum queue with "
                    "a delivery limit of 3"
                )
                assert f"mersal queues migrate --queue {error} --to classic" in refused
        assert await count_is(broker, error, 2)

    await eventually(lambda: policy_is(amqp_url, error, None), "the policy gone", timeout=15)
    await looked_at_five_times(options, ids, capsys)  # RabbitMQ 3 sets no limit by itself
    await eventually(lambda: count_is(broker, error, 2), "every dead letter still there")


# `mersal dlq drop`, and the progress of long drops and replays.


pytestmark = pytest.mark.integration


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
def error(amqp_url: str, broker: Broker) -> ErrorQueue:
    """An error queue no other test uses, deleted afterwards."""
    name = f"cli-{uuid4().hex[:10]}.error"
    broker.to_delete.add(name)
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
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [f"m{n:02}" for n in range(120)]
    await error.fill([failed(i, "pay.Charge.v1", "E", "boom") for i in ids])
    parking = ErrorQueue(error.url, f"{error.name}.parking")
    broker.to_delete.add(parking.name)
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
