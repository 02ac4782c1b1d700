"""A newcomer's mistakes on RabbitMQ: a wrong vhost or login, events that reach no queue."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mersal import App, ConfigurationError, RetryPolicy, Unroutable, message
from mersal.errors import Unreachable
from mersal_rabbitmq import RabbitMQTransport
from tests.support import RABBITMQ_HOST, eventually, free_port

pytestmark = pytest.mark.integration

RUN = uuid.uuid4().hex[:8]  # topics of this run only: the events exchange is the vhost's


@message(f"tests.newcomer.{RUN}.Unheard.v1")
@dataclass
class Unheard:
    n: int


@message(f"tests.newcomer.{RUN}.Lonely.v1")
@dataclass
class Lonely:
    n: int


@message(f"tests.newcomer.{RUN}.Heard.v1")
@dataclass
class Heard:
    n: int


@message(f"tests.newcomer.{RUN}.Command.v1")
@dataclass
class Command:
    n: int


async def test_a_vhost_that_does_not_exist_is_named_with_the_user(prefix: str) -> None:
    missing = f"mersal-missing-{uuid.uuid4().hex[:8]}"
    app = App(prefix, transport=f"amqp://guest:guest@{RABBITMQ_HOST}/{missing}")
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        f"RabbitMQ at amqp://guest:***@{RABBITMQ_HOST}/{missing} refused to open the vhost: vhost "
        f"{missing!r} does not exist or user 'guest' may not use it; fix the vhost in the URL, "
        f"or create it and let the user in (rabbitmqctl add_vhost {missing}; rabbitmqctl "
        f"set_permissions -p {missing} guest '.*' '.*' '.*')"
    )
    assert not app.running


async def test_a_refused_login_says_to_check_the_user_name_and_password(
    vhost: str, prefix: str
) -> None:
    app = App(prefix, transport=f"amqp://guest:not-the-password@{RABBITMQ_HOST}/{vhost}")
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        f"RabbitMQ at amqp://guest:***@{RABBITMQ_HOST}/{vhost} refused the login for user 'guest': "
        "check the user name and password"
    )
    assert "not-the-password" not in repr(raised.value)


async def test_a_broker_that_does_not_answer_is_still_unreachable(prefix: str) -> None:
    app = App(prefix, transport=f"amqp://guest:secret@{RABBITMQ_HOST}:{free_port()}/")
    with pytest.raises(Unreachable) as raised:
        await app.start()
    assert str(raised.value).startswith(
        f"cannot connect to RabbitMQ at amqp://guest:***@{RABBITMQ_HOST}"
    )
    assert "is it running, and are the host and port right?" in str(raised.value)


async def test_a_failed_tls_handshake_is_a_configuration_error_not_unreachable(
    vhost: str, prefix: str
) -> None:
    no_tls_there = f"amqps://guest:secret@{RABBITMQ_HOST}:5672/{vhost}"
    app = App(prefix, transport=no_tls_there)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    text = str(raised.value)
    assert text.startswith(
        f"the TLS handshake with RabbitMQ at amqps://guest:***@{RABBITMQ_HOST}:5672/"
    )
    assert text.endswith(
        "check the port (5671 for amqps), the server's certificate and the CA the client trusts "
        "(?cafile=... in the URL)"
    )
    assert not isinstance(raised.value, Unreachable)
    assert "secret" not in text


def _unheard_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mersal.rabbitmq" and r.levelno == logging.WARNING
    ]


def _said(topic: str) -> str:
    return (
        f"no queue subscribes to {topic}: nobody receives it (an app receives these events from "
        "the time it calls app.subscribe for them and starts); said once per type"
    )


async def test_an_event_no_queue_receives_is_logged_once_per_type_and_the_publish_succeeds(
    make_transport: Callable[..., RabbitMQTransport],
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.rabbitmq")
    errors = RetryPolicy(error_queue=f"{prefix}.err")
    heard: list[Heard] = []

    async def hear(event: Heard) -> None:
        heard.append(event)

    listener = App(f"{prefix}.listener", transport=make_transport(), retry=errors)
    listener.register(Heard, hear)
    listener.subscribe(Heard)
    publisher = App(f"{prefix}.publisher", transport=make_transport(), retry=errors)
    publisher.route(Command, f"{prefix}.nobody")
    async with listener, publisher:
        for n in range(3):
            assert await publisher.publish(Unheard(n))
        assert await publisher.publish(Lonely(1))
        await publisher.publish(Heard(7))
        await eventually(lambda: heard == [Heard(7)], "the subscribed event arrives", timeout=10)
        with pytest.raises(Unroutable, match=f"no queue named '{prefix}.nobody'"):
            await publisher.send(Command(1))  # a command to no queue still fails
    assert _unheard_warnings(caplog) == [
        _said(f"tests.newcomer.{RUN}.Unheard.v1"),
        _said(f"tests.newcomer.{RUN}.Lonely.v1"),
    ]


async def test_the_once_per_type_lasts_as_long_as_the_transport_across_restarts(
    make_transport: Callable[..., RabbitMQTransport],
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.rabbitmq")
    transport = make_transport()
    app = App(prefix, transport=transport, consume=False)
    for _ in range(2):
        async with app:
            await app.publish(Lonely(1))
    assert _unheard_warnings(caplog) == [_said(f"tests.newcomer.{RUN}.Lonely.v1")]
