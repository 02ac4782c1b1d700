"""The transport on a broker that is not RabbitMQ: Proton's example broker, queues by name.

The example broker forgets a message once it sent it, whatever the outcome, so only what
arrives is checked: nothing here depends on RabbitMQ's addresses or its 0-9-1 side.
"""

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mersal.errors import ConfigurationError, Unsendable
from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_amqp10 import Amqp10Transport

EXAMPLE_BROKER = Path("/usr/share/proton/examples/python/broker.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answering(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def example_broker() -> Iterator[str]:
    """The URL of a Proton example broker of this test's own (skipped where it is not installed)."""
    if not EXAMPLE_BROKER.exists():
        pytest.skip("Proton's example broker is not installed (libqpid-proton11-dev-examples)")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE_BROKER), "-a", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(100):
            if answering(port) or process.poll() is not None:
                break
            time.sleep(0.05)
        assert answering(port), process.stderr.read().decode() if process.stderr else ""
        yield f"amqp10://127.0.0.1:{port}/?topology=queues"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_messages_sent_to_a_queue_by_name_arrive_in_order_with_their_headers(
    example_broker: str,
) -> None:
    transport = Amqp10Transport(example_broker)
    await transport.start()
    try:
        await transport.declare("work")
        consumer = await transport.consume("work", prefetch=5)
        sent = [
            Envelope({Header.MESSAGE_ID: f"m-{n}", Header.TYPE: "t.Job", "x-n": str(n)}, b"%d" % n)
            for n in range(20)
        ]
        await transport.send([Outgoing("work", envelope) for envelope in sent])
        received = []
        async with asyncio.timeout(10):
            for _ in sent:
                delivery = await consumer.get()
                received.append(delivery.envelope)
                await delivery.ack()
        assert [envelope.body for envelope in received] == [envelope.body for envelope in sent]
        assert [envelope.headers["x-n"] for envelope in received] == [str(n) for n in range(20)]
        assert received[3].headers[Header.MESSAGE_ID] == "m-3"
        await consumer.close()
    finally:
        await transport.stop()


async def test_topics_and_delays_are_refused_where_the_broker_has_no_exchanges(
    example_broker: str,
) -> None:
    transport = Amqp10Transport(example_broker)
    await transport.start()
    try:
        with pytest.raises(ConfigurationError, match="topology=queues"):
            await transport.bind("work", "t.Happened")
        with pytest.raises(Unsendable, match="topology=queues"):
            await transport.send([Outgoing("t.Happened", Envelope({}, b""), publish=True)])
    finally:
        await transport.stop()
