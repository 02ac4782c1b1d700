"""Partitions on RabbitMQ: keyed sends split over single-active-consumer queues, in order."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import pytest
from rabbitmq_support import Broker, rabbitmqctl

from mersal import App, ConfigurationError, OutcomeUnknown, RetryPolicy
from mersal_rabbitmq import RabbitMQTransport
from tests.support import eventually, rabbitmqctl_rows

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
    broker.watch(app.transport)
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
