"""`mersal dlq list|show|replay|drop` end to end on RabbitMQ, run in-process as `main([...])`."""

from __future__ import annotations

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
from mersal_rabbitmq.management import Management
from tests.cli.conftest import Queues, mersal
from tests.cli.test_queues_migrate import queue_types
from tests.support import eventually, rabbitmqctl

pytestmark = pytest.mark.integration


@message("tests.cli.PlaceOrder.v1")
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


def orders_app(url: str, queues: Queues) -> Orders:
    """The orders app: one attempt, then its own error queue (both deleted after the test)."""
    prefix = f"cli-{uuid4().hex[:10]}"
    error_queue = f"{prefix}.error"
    app = App(
        f"{prefix}.orders",
        transport=url,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=error_queue),
    )
    queues.names.update({app.name, error_queue})
    orders = Orders(app, error_queue)
    app.register(PlaceOrder, orders.place)
    app.route(PlaceOrder, app.name)
    return orders


async def count_is(queues: Queues, queue: str, expected: int) -> bool:
    """Whether `queue` holds `expected` ready messages."""
    return await queues.count(queue) == expected


async def test_list_show_and_replay_a_failed_message(
    amqp_url: str, queues: Queues, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, queues)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    async with app:
        message_id = await app.send(PlaceOrder("o-1"))
        await eventually(lambda: count_is(queues, error, 1), "the message in the error queue")

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
            "tests.cli.PlaceOrder.v1",
            f"{__name__}.OutOfStock",
            "1",
            app.name,
        ]
        assert cells[5].endswith("Z") and cells[6] == "no stock for o-1"
        assert lines[2] == f"1 message(s) in {error!r}, all left there"
        await eventually(lambda: count_is(queues, error, 1), "the message back in the error queue")

        assert await mersal("dlq", "show", message_id, *options) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"message {message_id} in {error!r}:\nheaders:\n")
        assert f"  {Header.ERROR_TYPE}: {__name__}.OutOfStock\n" in shown
        assert f"  {Header.ERROR_MESSAGE}: no stock for o-1\n" in shown
        assert f"  {Header.ERROR_ATTEMPTS}: 1\n" in shown
        assert f"  {Header.ERROR_QUEUE}: {app.name}\n" in shown
        assert f"  {Header.ERROR_TRACEBACK}: Traceback (most recent call last):" in shown
        assert shown.endswith('{\n  "order_id": "o-1"\n}\n')
        await eventually(lambda: count_is(queues, error, 1), "the message still in the error queue")

        orders.broken = False
        assert await mersal("dlq", "replay", message_id, *options) == 0
        out = capsys.readouterr().out
        assert f"replayed {message_id} (tests.cli.PlaceOrder.v1) to {app.name!r}" in out
        assert out.endswith(f"replayed 1 of 1 message(s) from {error!r}\n")
        await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
        await eventually(lambda: count_is(queues, error, 0), "the error queue empty")

    order_id, attempt, headers = orders.handled[0]
    assert (order_id, attempt) == ("o-1", 1)  # a fresh set of retries
    assert headers[Header.MESSAGE_ID] == message_id
    assert not {Header.ERROR_TYPE, Header.ERROR_QUEUE, Header.ATTEMPT} & set(headers)


async def test_replay_all_to_another_queue_and_what_cannot_be_found(
    amqp_url: str, queues: Queues, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, queues)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    elsewhere = f"{app.name}.elsewhere"
    queues.names.add(elsewhere)
    async with app:
        ids = [await app.send(PlaceOrder(f"o-{n}")) for n in (1, 2)]
        await eventually(lambda: count_is(queues, error, 2), "both messages in the error queue")
        await app.transport.declare(elsewhere)

        assert await mersal("dlq", "replay", ids[0], "no-such-id", "--to", elsewhere, *options) == 1
        output = capsys.readouterr()
        assert f"replayed {ids[0]} (tests.cli.PlaceOrder.v1) to {elsewhere!r}" in output.out
        assert "no message 'no-such-id'" in output.err
        await eventually(lambda: count_is(queues, elsewhere, 1), "the message in the other queue")
        await eventually(lambda: count_is(queues, error, 1), "the other message left in error")

        assert await mersal("dlq", "replay", "--all", "--to", f"{app.name}.nowhere", *options) == 1
        assert "Unroutable" in capsys.readouterr().err
        await eventually(lambda: count_is(queues, error, 1), "the unroutable one still in error")

        assert await mersal("dlq", "show", "no-such-id", *options) == 1
        assert "no message 'no-such-id'" in capsys.readouterr().err


async def test_the_commands_explain_what_they_need(
    amqp_url: str,
    queues: Queues,
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
    queues: Queues,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_transport_in_environment: None,
) -> None:
    orders = orders_app(amqp_url, queues)
    app, error = orders.app, orders.error_queue
    monkeypatch.setattr(sys.modules[__name__], "ORDERS", app, raising=False)
    async with app:
        ids = [await app.send(PlaceOrder(f"o-{n}")) for n in (1, 2)]
        await eventually(lambda: count_is(queues, error, 2), "both messages in the error queue")

        assert await mersal("dlq", "list", "--app", APP_TARGET) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines[1:3]] == ids
        assert lines[3] == f"2 message(s) in {error!r}, all left there"

        assert await mersal("dlq", "show", ids[1], "--app", APP_TARGET) == 0
        assert capsys.readouterr().out.startswith(f"message {ids[1]} in {error!r}:\n")

        assert await mersal("dlq", "drop", ids[1], "--yes", "--app", APP_TARGET) == 0
        assert capsys.readouterr().out.endswith(f"dropped 1 of 1 message(s) from {error!r}\n")
        await eventually(lambda: count_is(queues, error, 1), "one message dropped")

        orders.broken = False
        assert await mersal("dlq", "replay", ids[0], "--app", APP_TARGET) == 0
        assert f"replayed {ids[0]} (tests.cli.PlaceOrder.v1) to {app.name!r}" in (
            capsys.readouterr().out
        )
        await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
        await eventually(lambda: count_is(queues, error, 0), "the error queue empty")
    assert [order_id for order_id, _, _ in orders.handled] == ["o-1"]  # o-2 was dropped


async def test_an_explicit_transport_and_queue_win_over_the_app(
    amqp_url: str,
    queues: Queues,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_transport_in_environment: None,
) -> None:
    orders = orders_app(amqp_url, queues)
    app, error = orders.app, orders.error_queue
    async with app:
        message_id = await app.send(PlaceOrder("o-1"))
        await eventually(lambda: count_is(queues, error, 1), "the message in the error queue")
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

    assert await mersal("dlq", "list", "--app", "tests.cli.no_such_module:app") == 2
    assert "cannot import 'tests.cli.no_such_module'" in capsys.readouterr().err


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
    """`dlq list`, `show` and a replay and a drop that choose nothing, five times over."""
    for _ in range(5):
        assert await mersal("dlq", "list", *options) == 0
        listed = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in listed[1:-1]] == list(ids)
        assert await mersal("dlq", "show", ids[-1], *options) == 0
        assert await mersal("dlq", "replay", "not-one-of-them", *options) == 1
        assert await mersal("dlq", "drop", "not-one-of-them", "--yes", *options) == 1
        capsys.readouterr()


async def test_the_error_queue_is_classic_and_looking_at_it_under_a_delivery_limit_keeps_all(
    amqp_url: str, vhost: str, queues: Queues, capsys: pytest.CaptureFixture[str]
) -> None:
    orders = orders_app(amqp_url, queues)  # quorum queues: the transport's default
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    with delivery_limit_policy(vhost, error, 1):  # what a quorum queue would drop by at once
        async with app:
            ids = [await app.send(PlaceOrder(f"o-{n}")) for n in range(3)]
            await eventually(lambda: count_is(queues, error, 3), "three dead letters")
            types = await queue_types(vhost)
            assert (types[app.name], types[error]) == ("quorum", "classic")

            await looked_at_five_times(options, ids, capsys)
            await eventually(lambda: count_is(queues, error, 3), "every dead letter still there")

            orders.broken = False
            assert await mersal("dlq", "replay", ids[0], *options) == 0
            assert await mersal("dlq", "drop", ids[1], "--yes", *options) == 0
            await eventually(lambda: len(orders.handled) == 1, "the replayed message handled")
            await eventually(lambda: count_is(queues, error, 1), "the one left alone still there")
    assert [order_id for order_id, _, _ in orders.handled] == ["o-0"]


async def test_a_quorum_error_queue_is_used_as_it_is_and_not_looked_at_under_a_delivery_limit(
    amqp_url: str,
    vhost: str,
    queues: Queues,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    orders = orders_app(amqp_url, queues)
    app, error = orders.app, orders.error_queue
    options = ("--transport", amqp_url, "--queue", error)
    async with await aio_pika.connect(amqp_url) as connection:  # left by an earlier release
        channel = await connection.channel()
        await channel.declare_queue(error, durable=True, arguments={"x-queue-type": "quorum"})
    with delivery_limit_policy(vhost, error, 3) as policy:
        async with app:  # accepted as it is, with a word on what it means
            ids = [await app.send(PlaceOrder(f"o-{n}")) for n in range(2)]
            await eventually(lambda: count_is(queues, error, 2), "two dead letters")
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
        assert await count_is(queues, error, 2)

    await eventually(lambda: policy_is(amqp_url, error, None), "the policy gone", timeout=15)
    await looked_at_five_times(options, ids, capsys)  # RabbitMQ 3 sets no limit by itself
    await eventually(lambda: count_is(queues, error, 2), "every dead letter still there")
