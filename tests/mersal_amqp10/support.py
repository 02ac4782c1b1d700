"""Helpers for the AMQP 1.0 tests: the broker's side of the connection, a raw proton client.

RabbitMQ 3.10 lists an AMQP 1.0 connection in its management API only as the direct
connections its plugin opens, one for each session, named for the client's socket: deleting
them there ends the sessions, not the connection. `drop_amqp10_connections` ends the
connection itself, from inside the broker.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.parse
from collections.abc import Sequence
from typing import Any

import proton
from aio_pika.abc import AbstractIncomingMessage
from proton.utils import BlockingConnection

from mersal_amqp10 import Amqp10Transport
from mersal_amqp10.topology import RabbitMQ3Topology
from mersal_rabbitmq import RabbitMQTransport
from tests.support import RABBITMQ_HOST, Broker, eventually, management, rabbitmqctl

APP_PROPERTIES = "x-amqp-1.0-app-properties"
"""The 0-9-1 header in which RabbitMQ 3.10 packs an AMQP 1.0 message's application properties."""
AMQP_VALUE = 0x77
"""The descriptor of an amqp-value section."""


def rabbitmq_side(transport: Amqp10Transport) -> RabbitMQTransport:
    """The 0-9-1 transport that declares the queues of `transport`."""
    topology = transport.topology
    assert isinstance(topology, RabbitMQ3Topology), topology
    return topology.rabbitmq


def amqp10_headers(incoming: AbstractIncomingMessage) -> dict[str, Any]:
    """The application properties of a message sent over AMQP 1.0 and read over 0-9-1."""
    packed = (incoming.headers or {}).get(APP_PROPERTIES)
    assert isinstance(packed, bytes), incoming.headers
    data = proton.Data()
    data.decode(packed)
    section = data.get_object()
    assert isinstance(section, proton.Described), section
    assert isinstance(section.value, dict), section.value
    return dict(section.value)


def amqp_decoded(encoded: bytes) -> object:
    """The value AMQP-encoded in `encoded`: bare, or the value of an amqp-value section."""
    data = proton.Data()
    data.decode(encoded)
    value = data.get_object()
    if isinstance(value, proton.Described) and value.descriptor == AMQP_VALUE:
        return value.value
    return value


async def count_unconsumed(broker: Broker, queue: str) -> int:
    """How many messages `queue` holds once no consumer is left on it.

    What a receiver left unsettled goes back a moment after its session or connection ended;
    the broker drops the consumer in the same step, so once none is left it is back.
    """

    async def unconsumed() -> tuple[int] | None:
        channel = await broker.connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        finally:
            await channel.close()
        result = declared.declaration_result
        return None if result.consumer_count else (int(result.message_count or 0),)

    (count,) = await eventually(unconsumed, f"no consumer left on {queue!r}", interval=0.02)
    return count


async def amqp10_connections(vhost: str, *, since: float = 0.0) -> list[dict[str, Any]]:
    """The management API's rows for the AMQP 1.0 connections made on `vhost` since `since`
    (a `time.time()`), waiting for one to be listed."""
    path = f"vhosts/{urllib.parse.quote(vhost, safe='')}/connections"

    async def listed() -> list[dict[str, Any]]:
        rows = await asyncio.to_thread(management, "GET", path)
        return [
            row
            for row in rows
            if str(row.get("protocol", "")).startswith("AMQP 1")
            and row.get("connected_at", 0) >= since * 1000 - 1000
        ]

    found: list[dict[str, Any]] = await eventually(
        listed, f"an AMQP 1.0 connection on {vhost!r}", timeout=10, interval=0.1
    )
    return found


async def end_amqp10_sessions(vhost: str, *, since: float = 0.0) -> int:
    """Close, through the management API, the direct connections it lists for the AMQP 1.0
    connections of `vhost` (on RabbitMQ 3.10 that ends their sessions); how many it closed.

    The API finds a connection by its name, which all the sessions of one AMQP 1.0 connection
    share: with more than one session it finds none (404), and closes nothing.
    """
    closed = 0
    for name in sorted({row["name"] for row in await amqp10_connections(vhost, since=since)}):
        quoted = urllib.parse.quote(name, safe="")
        try:
            await asyncio.to_thread(management, "DELETE", f"connections/{quoted}")
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
            continue
        closed += 1
    return closed


DROP = """
Ports = [PORTS],
Readers = [R || {{acceptor, _, 5672} = Listener, _} <- maps:to_list(ranch:info()),
  S <- ranch:procs(Listener, connections),
  {reader, R, _, _} <- supervisor:which_children(S), is_pid(R),
  {links, Links} <- [erlang:process_info(R, links)], P <- Links, is_port(P),
  {ok, {_, Peer}} <- [inet:peername(P)], lists:member(Peer, Ports)],
[exit(R, kill) || R <- lists:usort(Readers)],
length(lists:usort(Readers)).
"""
"""Erlang for `rabbitmqctl eval`: kill the readers of the AMQP connections from PORTS."""


async def drop_amqp10_connections(vhost: str, *, since: float = 0.0) -> int:
    """The broker drops the AMQP 1.0 connections made on `vhost` since `since` (their reader
    processes die, and the broker resets their sockets); how many it dropped."""
    rows = await amqp10_connections(vhost, since=since)
    ports = sorted({int(row["peer_port"]) for row in rows})
    script = DROP.replace("PORTS", ", ".join(map(str, ports)))
    return int((await asyncio.to_thread(rabbitmqctl, "eval", script)).strip())


def raw_send(vhost: str, address: str, messages: Sequence[proton.Message]) -> None:
    """Send `messages` to `address` with proton's own blocking client, each one settled."""
    connection = BlockingConnection(
        f"amqp://guest:guest@{RABBITMQ_HOST}:5672",
        timeout=10,
        virtual_host=f"vhost:{vhost}",
        allowed_mechs="PLAIN",
        allow_insecure_mechs=True,
        reconnect=False,
    )
    try:
        sender = connection.create_sender(address)
        for message in messages:
            sender.send(message)
    finally:
        connection.close()
