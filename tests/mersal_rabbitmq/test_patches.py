"""Mersal's workarounds for aiormq and pamqp act on Mersal's connections, not on others in the
process: a user's own aio-pika code beside a running transport behaves as without Mersal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aio_pika
import aiormq.channel
import pamqp.decode
import pytest

from mersal_rabbitmq import RabbitMQTransport, patches
from tests.mersal_rabbitmq.support import rabbitmqctl
from tests.support import eventually

pytestmark = pytest.mark.integration

NOT_UTF8 = b"\x00\x00\x00\x05" + b"\x02\xff\xfe" + b"t\x01"
"""A field table of one entry whose name is two bytes that are not UTF-8 (a boolean, true)."""
FAR_FUTURE = (2**63 - 1).to_bytes(8, "big")
"""A timestamp no datetime holds: 2**63 - 1 seconds after 1970."""
FAR_IN_A_TABLE = b"\x00\x00\x00\x0c" + b"\x02at" + b"T" + FAR_FUTURE
"""A field table of one entry, a timestamp no datetime holds."""


@pytest.fixture
async def running(url: str) -> AsyncIterator[RabbitMQTransport]:
    """A started transport: every workaround that Mersal installs is in place."""
    transport = RabbitMQTransport(url)
    await transport.start()
    yield transport
    await transport.stop()


async def test_a_plain_connection_reads_frames_as_pamqp_does(running: RabbitMQTransport) -> None:
    table = pamqp.decode.METHODS["table"]
    with pytest.raises(UnicodeDecodeError):
        table(NOT_UTF8)
    assert patches.own_context().run(table, NOT_UTF8) == (9, {"\ufffd\ufffd": True})
    timestamp = pamqp.decode.METHODS["timestamp"]
    with pytest.raises(ValueError, match="out of range"):
        timestamp(FAR_FUTURE)
    assert patches.own_context().run(timestamp, FAR_FUTURE) == (8, None)
    assert patches.own_context().run(table, FAR_IN_A_TABLE) == (16, {"at": None})


async def test_a_plain_connections_channels_are_aiormqs_own(
    running: RabbitMQTransport, url: str
) -> None:
    mersals = await running.open_channel()
    assert isinstance(await mersals.get_underlay_channel(), patches.GuardedChannel)
    assert vars(aiormq.channel.Channel)["lock"].fget.__module__ == "aiormq.channel"
    plain = await aio_pika.connect(url)
    try:
        channel = await plain.channel()
        assert type(await channel.get_underlay_channel()) is aiormq.channel.Channel
    finally:
        await plain.close()
        await mersals.close()


async def test_a_plain_connection_still_logs_its_failed_connects(
    running: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="aiormq")
    with contextlib.suppress(Exception):
        await aio_pika.connect("amqp://guest:guest@127.0.0.1:5699/", timeout=2)
    assert "error when creating transport" in caplog.text


async def test_a_lost_connection_is_logged_once_by_mersal_and_a_plain_one_as_aiormq_does(
    running: RabbitMQTransport, url: str, vhost: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)

    def aiormqs(text: str) -> int:
        return sum(r.name.startswith("aiormq") and text in r.message for r in caplog.records)

    plain = await aio_pika.connect(url)
    try:
        await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
        lost = "lost the connection to RabbitMQ"
        await eventually(lambda: lost in caplog.text, "Mersal's line", timeout=10)
        await eventually(lambda: running.connected, "reconnected", timeout=10)
        await eventually(lambda: aiormqs("reader exited") > 0, "the plain one's lines")
    finally:
        await plain.close()
    assert aiormqs("Unexpected connection close") == 1  # the plain connection's, not Mersal's
    assert aiormqs("reader exited abnormally") == 1
