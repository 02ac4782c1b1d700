"""Partitions on RabbitMQ: keyed sends split over single-active-consumer queues, in order."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import aio_pika
import pytest

from mersal import App, ConfigurationError, MessageContext, OutcomeUnknown, RetryPolicy
from mersal_rabbitmq import RabbitMQTransport, topology
from mersal_rabbitmq.topology import PartitionsMigrating, RingLocked, Topology
from tests.mersal_rabbitmq.support import Relay, rabbitmqctl, relay
from tests.support import Broker, eventually, rabbitmqctl_rows

pytestmark = pytest.mark.integration


@dataclass
class Step:
    """One step of one key's sequence."""

    key: str
    seq: int


def partitioned_app(name: str, url: str, broker: Broker, **options: object) -> App:
    """An app on the test vhost whose queues are deleted after the test."""
    app = App(name, transport=url, retry=RetryPolicy(error_queue=f"{name}.error"), **options)  # type: ignore[arg-type]
    assert isinstance(app.transport, RabbitMQTransport)
    broker.watch(app)
    return app


async def test_a_partitioned_app_declares_a_hash_exchange_and_single_active_partitions(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    app = partitioned_app(f"{prefix}.orders", url, broker, partitions=3)
    app.register(Step, ignore)
    async with app:
        queues = await asyncio.to_thread(
            rabbitmqctl_rows, "list_queues", "-p", vhost, "name", "type", "arguments"
        )
        exchanges = await asyncio.to_thread(
            rabbitmqctl_rows, "list_exchanges", "-p", vhost, "name", "type"
        )
    partitions = {row["name"]: row for row in queues if ".partition." in row["name"]}
    assert sorted(partitions) == [f"{prefix}.orders.partition.{n}" for n in range(3)]
    for row in partitions.values():
        assert row["type"] == "quorum"
        assert "x-single-active-consumer" in json.dumps(row["arguments"])
    kinds = {row["name"]: row["type"] for row in exchanges}
    assert kinds[f"{prefix}.orders.partitions"] == "x-consistent-hash"


async def test_keyed_sends_keep_their_order_across_instances_while_the_active_one_stops(
    url: str, broker: Broker, prefix: str
) -> None:
    name = f"{prefix}.orders"
    finished: list[tuple[str, int, str]] = []

    def instance(label: str) -> App:
        app = partitioned_app(name, url, broker, partitions=4, concurrency=8)

        async def handle(step: Step) -> None:
            await asyncio.sleep(random.uniform(0, 0.004))
            finished.append((step.key, step.seq, label))

        app.register(Step, handle)
        return app

    first, second = instance("first"), instance("second")
    sender = partitioned_app(f"{prefix}.sender", url, broker, consume=False)
    sender.route(Step, name)
    keys = [f"k{n}" for n in range(20)]
    steps = 15
    await first.start()  # the first to consume is active on every partition; the second waits
    async with sender, second:
        try:
            for seq in range(steps):
                for key in keys:
                    await sender.send(Step(key, seq), partition_key=key)
                if seq == 5:
                    await eventually(lambda: len(finished) >= 60, "some steps handled")
                    await first.stop()  # its partitions move to the second instance
        finally:
            await first.stop()
        await eventually(
            lambda: (
                {(key, seq) for key, seq, _ in finished}
                >= {(k, s) for k in keys for s in range(steps)}
            ),
            "every step handled",
            timeout=30,
        )
    for key in keys:
        seen: list[int] = []
        for done_key, seq, _ in finished:
            if done_key == key and seq not in seen:
                seen.append(seq)
        assert seen == list(range(steps)), f"{key} handled out of order: {seen}"
    assert {label for *_, label in finished} == {"first", "second"}


async def test_each_key_keeps_its_order_through_stops_on_a_quorum_queue(
    url: str, broker: Broker, prefix: str
) -> None:
    name = f"{prefix}.orders"
    finished: list[tuple[str, int]] = []

    def instance() -> App:
        app = partitioned_app(name, url, broker, concurrency=8, grace_period=5)

        async def handle(step: Step) -> None:
            await asyncio.sleep(random.uniform(0, 0.02))
            finished.append((step.key, step.seq))

        app.register(Step, handle)
        app.route(Step, name)
        return app

    keys = [f"k{n}" for n in range(8)]
    steps = 40
    async with instance():  # declares the queue; nothing to take yet
        pass
    sender = partitioned_app(f"{prefix}.sender", url, broker, consume=False)
    sender.route(Step, name)
    async with sender:
        for seq in range(steps):
            for key in keys:
                await sender.send(Step(key, seq), partition_key=key)
    for _ in range(20):  # stop while keys have messages waiting in the worker, again and again
        before = len(finished)
        async with instance():
            await eventually(
                lambda b=before: len(finished) >= min(b + 15, len(keys) * steps), "progress"
            )
        if len({*finished}) == len(keys) * steps:
            break
    assert {*finished} == {(key, seq) for key in keys for seq in range(steps)}
    for key in keys:
        firsts: list[int] = []
        for done_key, seq in finished:
            if done_key == key and seq not in firsts:
                firsts.append(seq)
        assert firsts == list(range(steps)), f"{key} out of order: {firsts}"


async def test_sends_without_a_key_and_senders_unaware_of_partitions_still_arrive(
    url: str, broker: Broker, prefix: str
) -> None:
    name = f"{prefix}.orders"
    got: list[Step] = []
    app = partitioned_app(name, url, broker, partitions=2)

    async def handle(step: Step) -> None:
        got.append(step)

    app.register(Step, handle)
    app.route(Step, name)
    async with app:
        await app.send(Step("none", 1))
        await app.send(Step("keyed", 2), partition_key="keyed")
        await app.send(Step("long", 3), partition_key="x" * 1000)  # over a routing key's 255
        await eventually(lambda: len(got) == 3, "all three handled")
    assert sorted(step.seq for step in got) == [1, 2, 3]


@pytest.mark.parametrize(
    ("then", "refusal"), [(2, "more than 2 partitions"), (None, "has partitions")]
)
async def test_fewer_partitions_than_the_queue_has_or_none_are_refused(
    url: str, broker: Broker, prefix: str, then: int | None, refusal: str
) -> None:
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=4)
    app.register(Step, ignore)
    async with app:
        pass
    fewer = partitioned_app(name, url, broker, partitions=then)
    fewer.register(Step, ignore)
    with pytest.raises(ConfigurationError, match=refusal):
        await fewer.start()


async def test_a_deleted_partition_comes_back_bound_to_the_exchange(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=2)
    app.register(Step, ignore)

    async def bound() -> bool:
        rows = await asyncio.to_thread(
            rabbitmqctl_rows, "list_bindings", "-p", vhost, "source_name", "destination_name"
        )
        return {"source_name": f"{name}.partitions", "destination_name": partition} in rows

    partition = f"{name}.partition.0"
    async with app:
        await asyncio.to_thread(rabbitmqctl, "delete_queue", "-p", vhost, partition)
        await eventually(bound, "the partition declared and bound again", timeout=15)


@pytest.mark.parametrize("deleted", ["while it runs", "while it is stopped", "while it is away"])
async def test_keys_keep_their_partition_after_a_partition_was_deleted(
    url: str, vhost: str, broker: Broker, prefix: str, deleted: str
) -> None:
    async with relay(url) as node:  # the app's node, to disconnect it while it runs
        await keys_keep_their_partition(node, vhost, broker, prefix, deleted)


async def keys_keep_their_partition(
    node: Relay, vhost: str, broker: Broker, prefix: str, deleted: str
) -> None:
    """Send a round of keyed messages, delete a partition (`deleted`), send another round."""
    name = f"{prefix}.orders"
    app = partitioned_app(name, node.url(vhost, "?reconnect_interval=0.1"), broker, partitions=3)
    handled: dict[tuple[int, str], str] = {}

    async def handle(step: Step, context: MessageContext) -> None:
        assert context.delivery is not None
        handled[(step.seq, step.key)] = context.delivery.queue

    app.register(Step, handle)
    app.route(Step, name)
    keys = [f"k{n}" for n in range(24)]

    async def send_round(seq: int) -> None:
        for key in keys:
            await app.send(Step(key, seq), partition_key=key)
        await eventually(lambda: len(handled) == seq * len(keys), f"round {seq} handled")

    async def bound_in_order() -> bool:
        rows = await asyncio.to_thread(
            rabbitmqctl_rows, "list_bindings", "-p", vhost, "source_name", "destination_name"
        )
        exchanges = await asyncio.to_thread(rabbitmqctl_rows, "list_exchanges", "-p", vhost, "name")
        marker = {"name": f"{name}.partitions.migrating"}
        return marker not in exchanges and all(
            {"source_name": f"{name}.partitions", "destination_name": f"{name}.partition.{n}"}
            in rows
            for n in range(3)
        )

    async with app:
        await send_round(1)
        if deleted == "while it is away":
            await node.die()
            await eventually(lambda: not app.transport.connected, "disconnected")
            await broker.channel.queue_delete(f"{name}.partition.0")
            await node.start()
        if deleted == "while it runs":
            await broker.channel.queue_delete(f"{name}.partition.0")
        if deleted != "while it is stopped":
            await eventually(bound_in_order, "the partitions bound again", timeout=15)
            await send_round(2)
    if deleted == "while it is stopped":
        await broker.channel.queue_delete(f"{name}.partition.0")
        async with app:
            await send_round(2)
    moved = [key for key in keys if handled[(1, key)] != handled[(2, key)]]
    assert moved == []
    assert len({handled[(1, key)] for key in keys}) == 3  # the keys are spread over all three


async def cut_short_rebuild(broker: Broker, name: str, bound: int) -> None:
    """Leave the ring as an instance killed while it made it again: marker, a few bound."""
    channel = broker.channel
    marker = f"{name}.partitions.migrating"
    await channel.declare_exchange(marker, aio_pika.ExchangeType.FANOUT, durable=True)
    await channel.exchange_delete(f"{name}.partitions")
    exchange = await channel.declare_exchange(
        f"{name}.partitions", "x-consistent-hash", durable=True
    )
    for index in range(bound):
        queue = await channel.get_queue(f"{name}.partition.{index}", ensure=False)
        await queue.bind(exchange, "1")


async def ring_bound(vhost: str, name: str, count: int) -> bool:
    """Whether every partition is bound to the exchange."""
    rows = await asyncio.to_thread(
        rabbitmqctl_rows, "list_bindings", "-p", vhost, "source_name", "destination_name"
    )
    return all(
        {"source_name": f"{name}.partitions", "destination_name": f"{name}.partition.{n}"} in rows
        for n in range(count)
    )


@pytest.mark.parametrize("finisher", ["a starting instance", "a keyed send of a running one"])
async def test_a_rebuild_cut_short_is_finished_and_keys_keep_their_partition(
    url: str, broker: Broker, prefix: str, finisher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(topology, "MARKER_RECHECK", 0.0)
    name = f"{prefix}.orders"
    handled: dict[tuple[int, str], str] = {}

    async def handle(step: Step, context: MessageContext) -> None:
        assert context.delivery is not None
        handled[(step.seq, step.key)] = context.delivery.queue

    def instance() -> App:
        app = partitioned_app(name, url, broker, partitions=3)
        app.register(Step, handle)
        app.route(Step, name)
        return app

    keys = [f"k{n}" for n in range(24)]

    async def send_round(app: App, seq: int) -> None:
        for key in keys:
            await app.send(Step(key, seq), partition_key=key)
        await eventually(lambda: len(handled) == seq * len(keys), f"round {seq} handled")

    first = instance()
    async with first:
        await send_round(first, 1)
        if finisher == "a keyed send of a running one":
            await cut_short_rebuild(broker, name, bound=1)
            await send_round(first, 2)
    if finisher == "a starting instance":
        await cut_short_rebuild(broker, name, bound=1)
        second = instance()
        async with second:
            await send_round(second, 2)
    assert [key for key in keys if handled[(1, key)] != handled[(2, key)]] == []
    assert not await broker.exchange_exists(f"{name}.partitions.migrating")


async def test_a_keyed_send_waits_while_another_connection_holds_the_ring_lock(
    url: str, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(topology, "MARKER_RECHECK", 0.0)
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=2)
    app.register(Step, ignore)
    app.route(Step, name)
    lock = f"{name}.partitions.lock"
    async with app:
        await app.send(Step("k", 1), partition_key="k")
        await broker.channel.declare_queue(lock, exclusive=True, auto_delete=True)
        await cut_short_rebuild(broker, name, bound=1)
        with pytest.raises(PartitionsMigrating):  # not through the half-made ring
            await app.send(Step("k", 2), partition_key="k")
        await broker.channel.queue_delete(lock)  # its holder is gone: the next send finishes
        await app.send(Step("k", 3), partition_key="k")
        assert not await broker.exchange_exists(f"{name}.partitions.migrating")


@pytest.mark.parametrize("attempt", range(4))
async def test_two_instances_starting_at_once_on_new_queues_both_start_with_the_ring_in_order(
    url: str, vhost: str, broker: Broker, prefix: str, attempt: int
) -> None:
    name = f"{prefix}.orders"
    apps = [partitioned_app(name, url, broker, partitions=8) for _ in range(2)]
    for app in apps:
        app.register(Step, ignore)
    try:
        await asyncio.gather(*(app.start() for app in apps))
        assert await ring_bound(vhost, name, 8)
        assert not await broker.exchange_exists(f"{name}.partitions.migrating")
    finally:
        for app in apps:
            await app.stop()


async def test_a_send_only_app_does_not_send_through_a_half_made_ring(
    url: str, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(topology, "MARKER_RECHECK", 0.0)
    name = f"{prefix}.orders"
    owner = partitioned_app(name, url, broker, partitions=3)
    owner.register(Step, ignore)
    owner.route(Step, name)
    sender = partitioned_app(f"{prefix}.front", url, broker, consume=False)
    sender.route(Step, name)
    async with owner, sender:
        await sender.send(Step("k", 1), partition_key="k")  # it knows the queue is partitioned
        await cut_short_rebuild(broker, name, bound=1)
        with pytest.raises(PartitionsMigrating):  # not to a partition the ring half-holds
            await sender.send(Step("k", 2), partition_key="k")
        await owner.send(Step("k", 3), partition_key="k")  # an owner finishes the ring
        await sender.send(Step("k", 4), partition_key="k")
        assert not await broker.exchange_exists(f"{name}.partitions.migrating")


async def test_a_start_waits_for_the_ring_lock_a_bounded_time(
    url: str, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(topology, "RING_LOCK_WAIT", 0.5)
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=2)
    app.register(Step, ignore)
    async with app:
        pass
    await broker.channel.declare_queue(f"{name}.partitions.lock", exclusive=True, auto_delete=True)
    await cut_short_rebuild(broker, name, bound=1)
    with pytest.raises(RingLocked, match=rf"{name}\.partitions\.lock.*let it finish"):
        await asyncio.wait_for(app.start(), 15)
    await app.stop()
    await broker.channel.exchange_delete(f"{name}.partitions.migrating")


async def test_a_stop_while_the_ring_is_made_again_lets_it_finish_first(
    url: str, vhost: str, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=3)
    app.register(Step, ignore)
    binding = asyncio.Event()
    slow = False
    bind = Topology._bind_partition

    async def slow_bind(self: Topology, queue: str, exchange: str) -> None:
        if slow:
            binding.set()
            await asyncio.sleep(0.3)
        await bind(self, queue, exchange)

    monkeypatch.setattr(Topology, "_bind_partition", slow_bind)
    await app.start()
    try:
        slow = True
        await broker.channel.queue_delete(f"{name}.partition.0")
        await asyncio.wait_for(binding.wait(), 15)
    finally:
        await app.stop()
    assert not await broker.exchange_exists(f"{name}.partitions.migrating")
    assert await ring_bound(vhost, name, 3)


@pytest.mark.parametrize("exchange", ["deleted", "made again without bindings"])
async def test_a_keyed_send_while_the_partitions_exchange_is_made_again_is_sent_again(
    url: str, broker: Broker, prefix: str, exchange: str
) -> None:
    name = f"{prefix}.orders"
    app = partitioned_app(name, url, broker, partitions=2)
    app.register(Step, ignore)
    app.route(Step, name)
    async with app:
        await broker.channel.exchange_delete(f"{name}.partitions")
        if exchange == "made again without bindings":
            await broker.channel.declare_exchange(
                f"{name}.partitions", "x-consistent-hash", durable=True
            )
        with pytest.raises(OutcomeUnknown, match="send it again"):  # kept, not refused
            await app.send(Step("k", 1), partition_key="k")


async def test_a_sender_forgets_partitions_that_were_deleted(
    url: str, broker: Broker, prefix: str
) -> None:
    name = f"{prefix}.orders"
    receiver = partitioned_app(name, url, broker, partitions=2)
    receiver.register(Step, ignore)
    async with receiver:
        pass
    sender = partitioned_app(f"{prefix}.sender", url, broker, consume=False)
    sender.route(Step, name)
    async with sender:
        await sender.send(Step("k", 1), partition_key="k")
        channel = broker.channel
        await channel.exchange_delete(f"{name}.partitions")
        outcomes = []
        for seq in (2, 3):
            try:
                await sender.send(Step("k", seq), partition_key="k")
                outcomes.append("sent")
            except OutcomeUnknown:
                outcomes.append("unknown")
    assert outcomes in (["unknown", "sent"], ["sent", "sent"])
    assert (await broker.get(name)).body  # the last one went to the queue itself


@pytest.mark.parametrize("partitions", [0, -1, 257, 2.5, True])
def test_a_wrong_number_of_partitions_is_a_configuration_error(partitions: object) -> None:
    with pytest.raises(ConfigurationError, match="partitions"):
        App("orders", transport="memory://", partitions=partitions)  # type: ignore[arg-type]


def test_a_send_only_app_has_no_partitions() -> None:
    with pytest.raises(ConfigurationError, match="send-only"):
        App("orders", transport="memory://", partitions=2, consume=False)


async def ignore(step: Step) -> None:
    """A handler that does nothing."""
