"""Passwords in transport and database URLs appear in no repr, log record or exception text."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from mersal import App, MersalError
from mersal.cli import main
from mersal.urls import mask
from tests.fuzz.rig import FUZZ
from tests.support import eventually

SECRET = "s3cret"


@pytest.mark.parametrize(
    ("url", "secrets", "masked"),
    [
        ("amqp://user:s3cret@127.0.0.1:1/", ["s3cret"], "amqp://user:***@127.0.0.1:1/"),
        ("amqp://user@127.0.0.1/", [], "amqp://user@127.0.0.1/"),
        ("amqp://:s3cret@h/", ["s3cret"], "amqp://:***@h/"),
        ("amqp://user:s3@cr@t@h/vhost", ["s3@cr@t", "s3", "cr@t"], "amqp://user:***@h/vhost"),
        ("amqp://user:s3%40cr%3At@h/", ["s3%40cr%3At", "s3@cr:t"], "amqp://user:***@h/"),
        ("amqp://user:s3cret:more@h/", ["s3cret", "more"], "amqp://user:***@h/"),
        ("user:s3cret@h:5672/vhost", ["s3cret"], "user:***@h:5672/vhost"),
        ("//user:s3cret@h/", ["s3cret"], "//user:***@h/"),
        ("AMQPS://USER:S3CRET@H/", ["S3CRET"], "AMQPS://USER:***@H/"),
        ("amqp://user:s3cret@[::1]:5672/", ["s3cret"], "amqp://user:***@[::1]:5672/"),
        (
            "amqps://user:s3cret@rabbit:5671/prod?cafile=/etc/ca.pem&certfile=/c.pem&keyfile=/k.pem",
            ["s3cret"],
            "amqps://user:***@rabbit:5671/prod?cafile=/etc/ca.pem&certfile=/c.pem&keyfile=/k.pem",
        ),
        (
            "postgresql+asyncpg://app:s3cret@db:5432/orders?ssl=require",
            ["s3cret"],
            "postgresql+asyncpg://app:***@db:5432/orders?ssl=require",
        ),
        (
            "postgresql+asyncpg://app@db/orders?password=s3cret&ssl=require",
            ["s3cret"],
            "postgresql+asyncpg://app@db/orders?password=***&ssl=require",
        ),
        (
            "postgresql+asyncpg://app:s3cret@db/orders?ssl=verify-full&sslpassword=k3y#x",
            ["s3cret", "k3y"],
            "postgresql+asyncpg://app:***@db/orders?ssl=verify-full&sslpassword=***#x",
        ),
        ("postgresql://db/orders?PASSWORD=p@ss", ["p@ss"], "postgresql://db/orders?PASSWORD=***"),
        ("memory://", [], "memory://"),
        ("memory://billing", [], "memory://billing"),
    ],
)
def test_mask_hides_every_password(url: str, secrets: list[str], masked: str) -> None:
    assert mask(url) == masked
    for secret in secrets:
        assert secret not in mask(url)


_password_characters = st.characters(
    min_codepoint=33, max_codepoint=0x2FF, exclude_characters="&#"
)  # '&' and '#' end a query value; in the user info any character is fair game


@FUZZ
@given(
    password=st.text(_password_characters, min_size=6, max_size=30),
    scheme=st.sampled_from(["amqp", "amqps", "postgresql+asyncpg", "sqlite+aiosqlite", ""]),
    where=st.sampled_from(["user info", "query"]),
)
def test_mask_never_shows_a_password_wherever_it_is(password: str, scheme: str, where: str) -> None:
    prefix = f"{scheme}://" if scheme else ""
    if where == "user info":
        url = f"{prefix}user:{password}@rabbit.internal:5672/prod?heartbeat=30"
    else:
        url = f"{prefix}app@db.internal/orders?ssl=require&password={password}"
    assume(url.count(password) == 1)  # e.g. a password of "rabbit" or "sqlite"

    assert password not in mask(url)


def test_reprs_show_the_url_masked() -> None:
    app = App("orders", transport="amqp://user:s3cret@127.0.0.1:1/")

    assert repr(app) == "<App 'orders' on amqp://user:***@127.0.0.1:1/>"
    assert repr(app.transport) == "<RabbitMQTransport amqp://user:***@127.0.0.1:1/>"
    assert SECRET not in str(app.transport)


def texts_of(error: BaseException) -> Iterator[str]:
    """Every text an exception shows: message, repr, traceback, and those of its context."""
    yield "".join(traceback.format_exception(error))
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield str(current)
        yield repr(current)
        yield repr(current.args)
        current = current.__cause__ or current.__context__


def texts_of_records(records: list[logging.LogRecord]) -> Iterator[str]:
    """Every text a log record shows, and the arguments it was given."""
    for record in records:
        yield record.getMessage()
        yield repr(record.args)
        if record.exc_info and record.exc_info[1] is not None:
            yield from texts_of(record.exc_info[1])


@pytest.mark.parametrize(
    ("transport", "database"),
    [
        ("amqp://user:s3cret@127.0.0.1:1/", None),  # nothing listens there
        ("amqp://guest:s3cret@127.0.0.1/", None),  # RabbitMQ refuses the login (if it runs)
        ("amqp://user:s3cret@no-such-host.invalid/", None),
        ("amqps://user:s3cret@127.0.0.1:1/?cafile=/nonexistent/ca.pem", None),
        ("memory://", "postgresql+asyncpg://app:s3cret@127.0.0.1:1/orders"),
        ("memory://", "postgresql+asyncpg://app@127.0.0.1:1/orders?password=s3cret"),
        ("memory://", "postgresql+nosuchdriver://app:s3cret@127.0.0.1:1/orders"),
        ("memory://", "app:s3cret@127.0.0.1/orders"),
    ],
)
async def test_a_failed_start_leaks_the_password_nowhere(
    transport: str, database: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # what aio-pika, aiormq and SQLAlchemy log, too
    app = App("orders", transport=transport, database=database)

    with pytest.raises(Exception) as raised:  # any type: what it says is tested
        async with asyncio.timeout(30):
            await app.start()
    await eventually(  # then nothing is left to log after the failure
        lambda: asyncio.all_tasks() == {asyncio.current_task()},
        "every task the failed start left behind ended",
    )

    assert not app.running
    texts = [*texts_of(raised.value), *texts_of_records(caplog.records), repr(app)]
    leaks = [text for text in texts if SECRET in text]
    assert leaks == []


async def test_a_malformed_amqp_url_is_a_configuration_error() -> None:
    app = App("orders", transport="amqp://user:s3cret@127.0.0.1:notaport/")

    with pytest.raises(MersalError):
        await app.start()


@pytest.mark.parametrize(
    "database",
    [
        "postgresql+asyncpg://app:s3cret@127.0.0.1:1/orders",
        "postgresql+asyncpg://app@127.0.0.1:1/orders?password=s3cret",
    ],
)
def test_mersal_db_upgrade_reports_a_failure_without_the_password(
    database: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    assert main(["db", "upgrade", "--database", database]) == 2

    output = capsys.readouterr()
    assert "***" in output.err
    assert SECRET not in output.out + output.err
    assert [text for text in texts_of_records(caplog.records) if SECRET in text] == []
