"""The dead-letter store: ingested from the error queue, grouped, looked at, retried, deleted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from sqlalchemy import event, func, select

from mersal import App, Header
from mersal.dead_letters import DeadLetter, DeadLetters, Held
from mersal.messages import Envelope
from mersal.transport import Outgoing, Transport
from mersal.transport.memory import MemoryTransport
from mersal.urls import mask
from mersal_rabbitmq import RabbitMQTransport
from mersal_sqlalchemy.dead_letters import DeadLetterStore
from tests.payments import Charge, Payments, running_payments
from tests.support import eventually, mersal

IDLE = 0.2


@pytest.fixture
async def payments(memory_url: str, database: str, prefix: str) -> AsyncIterator[Payments]:
    """The payments app on the memory broker, on PostgreSQL or SQLite."""
    async for payments in running_payments(memory_url, database, prefix):
        yield payments


@pytest.fixture
async def rabbit_payments(amqp_url: str, postgres_url: str, prefix: str) -> AsyncIterator[Payments]:
    """The payments app on RabbitMQ and PostgreSQL."""
    async for payments in running_payments(amqp_url, postgres_url, prefix):
        yield payments


@pytest.fixture
async def operator(payments: Payments, memory_url: str) -> AsyncIterator[Transport]:
    """An operator's transport on the app's broker."""
    async for transport in started(MemoryTransport(memory_url)):
        yield transport


async def started(transport: Transport) -> AsyncIterator[Transport]:
    """`transport`, started, and stopped afterwards."""
    await transport.start()
    try:
        yield transport
    finally:
        await transport.stop()


async def error_count(transport: Transport, queue: str) -> int:
    """The messages in the error queue, looked at (left in place)."""
    return len(await DeadLetters(transport, queue, idle=IDLE).peek(1_000))


async def fail(payments: Payments, operator: Transport, *order_ids: str) -> list[str]:
    """Send Charge commands that fail; their ids, once all are in the error queue."""
    ids = [await payments.app.send(Charge(order_id)) for order_id in order_ids]
    queue = payments.error_queue

    async def all_there() -> bool:
        return await error_count(operator, queue) == len(ids)

    await eventually(all_there, "the dead letters", timeout=10)
    return ids


async def test_ingesting_stores_each_failure_with_why_and_empties_the_error_queue(
    payments: Payments, operator: Transport
) -> None:
    ids = await fail(payments, operator, "o-1", "o-2", "o-3")

    stored = await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))

    assert stored == 3
    assert await error_count(operator, payments.error_queue) == 0
    page = await payments.store.page()
    assert sorted(failure.message_id or "" for failure in page) == sorted(ids)
    assert [failure.id for failure in page] == sorted(
        (failure.id for failure in page), reverse=True
    )
    first = next(failure for failure in page if failure.message_id == ids[0])
    assert first.type_name == "tests.payments.Charge.v1"
    assert first.error_type == "tests.payments.CardDeclined"
    assert first.error_message == "card declined for order o-1"
    assert first.attempts == 1
    assert first.source_queue == payments.app.name
    assert first.error_queue == payments.error_queue
    assert first.handler == "tests/payments.py:charge"
    shown = await payments.store.get(first.id)
    assert shown is not None and shown.body is not None
    assert b'"o-1"' in shown.body
    assert shown.headers is not None and shown.headers[Header.MESSAGE_ID] == ids[0]
    assert shown.traceback is not None and "CardDeclined" in shown.traceback


async def test_failures_that_differ_only_in_their_values_are_one_group(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "17", "18", "19")

    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))

    [group] = await payments.store.groups()
    assert group.count == 3
    assert group.label == "CardDeclined: card declined for order <n> (in tests/payments.py:charge)"
    assert group.error_type == "tests.payments.CardDeclined"
    assert group.first_seen is not None and group.last_seen is not None
    assert group.first_seen <= group.last_seen
    assert await payments.store.count(group.key) == 3


async def test_a_retried_group_is_handled_exactly_once_and_leaves_the_store(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "o-1", "o-2")
    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))
    [group] = await payments.store.groups()
    payments.broken = False

    retried = await payments.store.retry_group(group.key)

    assert (retried.sent, retried.without_queue) == (2, [])
    await eventually(lambda: sorted(payments.handled) == ["o-1", "o-2"], "the retried orders")
    assert await payments.store.count() == 0
    assert await error_count(operator, payments.error_queue) == 0
    await asyncio.sleep(0)  # a second handling would have to come from the same relay batch
    assert sorted(payments.handled) == ["o-1", "o-2"]


async def test_a_retry_that_fails_again_comes_back_as_a_new_failure_of_its_group(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "o-1")
    dead_letters = DeadLetters(operator, payments.error_queue, idle=IDLE)
    await payments.store.ingest_all(dead_letters)
    [before] = await payments.store.page()

    await payments.store.retry([before.id])
    await eventually(lambda: error_count(operator, payments.error_queue), "the second failure")
    await payments.store.ingest_all(dead_letters)

    [after] = await payments.store.page()
    assert after.id != before.id
    assert after.message_id == before.message_id
    assert after.group_key == before.group_key
    shown = await payments.store.get(after.id)
    assert shown is not None and shown.headers is not None
    assert shown.headers[Header.REPLAYS] == "1"


async def test_deleting_removes_only_the_chosen_failures(
    payments: Payments, operator: Transport
) -> None:
    ids = await fail(payments, operator, "o-1", "o-2", "o-3")
    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))
    page = await payments.store.page()
    first = next(failure for failure in page if failure.message_id == ids[0])

    assert await payments.store.delete([first.id]) == 1
    assert await payments.store.delete([first.id]) == 0

    left = await payments.store.page()
    assert sorted(failure.message_id or "" for failure in left) == sorted(ids[1:])
    [group] = await payments.store.groups()
    assert await payments.store.delete_group(group.key) == 2
    assert await payments.store.count() == 0
    assert payments.handled == []


async def test_search_matches_text_literally_and_pages_go_back_by_id(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "50%_off", "5000", "other")
    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))

    found = await payments.store.page(search="50%_")
    assert [failure.error_message for failure in found] == ["card declined for order 50%_off"]
    newest, *older = await payments.store.page(limit=3)
    assert await payments.store.page(before=newest.id, limit=2) == older


async def test_a_hostile_dead_letter_is_stored_whole_and_a_retry_without_a_queue_leaves_it(
    payments: Payments, operator: Transport
) -> None:
    headers = {
        Header.MESSAGE_ID: "m\x00<script>alert(1)</script>",
        Header.ERROR_ATTEMPTS: "99999999999999999999",
        Header.FAILED_AT: "not a time",
        "x-odd": "\x00",
    }
    await operator.send([Outgoing(payments.error_queue, Envelope(headers, b"\xff\x00 raw"))])
    await eventually(lambda: error_count(operator, payments.error_queue), "the hostile message")

    assert (
        await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE)) == 1
    )

    [failure] = await payments.store.page()
    assert failure.message_id == "m\ufffd<script>alert(1)</script>"
    assert failure.attempts is None and failure.failed_at is None
    assert failure.group_label == "no error type"
    shown = await payments.store.get(failure.id)
    assert shown is not None
    assert shown.body == b"\xff\x00 raw"
    assert shown.headers == headers
    retried = await payments.store.retry([failure.id])
    assert (retried.sent, retried.without_queue) == (0, [failure.id])
    assert await payments.store.count() == 1


async def test_a_delivery_again_of_a_retried_or_deleted_failure_is_not_stored_again(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "o-1", "o-2")
    dead_letters = DeadLetters(operator, payments.error_queue, idle=IDLE)
    copies = [item.envelope for item in await dead_letters.peek(10)]
    await payments.store.ingest_all(dead_letters)
    retried, deleted = await payments.store.page()
    payments.broken = False
    await payments.store.retry([retried.id])
    await payments.store.delete([deleted.id])
    await eventually(lambda: payments.handled != [], "the retried charge handled")

    # as after a crash between the commit of their rows and their acks
    await operator.send([Outgoing(payments.error_queue, copy) for copy in copies])
    done = await payments.store.ingest(dead_letters)

    assert (done.stored, done.duplicates) == (0, 2)
    assert await payments.store.count() == 0
    assert await payments.store.get(retried.id) is None
    assert payments.handled == [retried.error_message.rpartition(" ")[2]]  # type: ignore[union-attr]


async def outbox_rows(payments: Payments) -> int:
    """The rows the payments app's outbox holds."""
    store = payments.store
    async with store.engine.connect() as connection:
        counted = select(func.count()).select_from(store.tables.outbox)
        return int((await connection.execute(counted)).scalar_one())


async def test_tombstones_older_than_the_retention_are_forgotten(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "o-1")
    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))
    [failure] = await payments.store.page()
    await payments.store.delete([failure.id])

    assert await payments.store.forget(older_than=3600) == 0
    assert await payments.store.forget(older_than=-1) == 1
    assert await payments.store.forget(older_than=-1) == 0


async def test_a_failure_whose_source_is_the_error_queue_itself_is_kept_not_retried(
    payments: Payments, operator: Transport
) -> None:
    headers = {Header.ERROR_QUEUE: payments.error_queue, Header.ERROR_TYPE: "Boom"}
    await operator.send([Outgoing(payments.error_queue, Envelope(headers, b"{}"))])
    await payments.store.ingest_all(DeadLetters(operator, payments.error_queue, idle=IDLE))
    [failure] = await payments.store.page()

    retried = await payments.store.retry([failure.id])

    assert (retried.sent, retried.without_queue) == (0, [failure.id])
    assert await payments.store.count() == 1
    assert await outbox_rows(payments) == 0


async def test_a_header_no_transport_can_send_does_not_hold_back_its_group(
    payments: Payments, operator: Transport
) -> None:
    await fail(payments, operator, "o-1")
    dead_letters = DeadLetters(operator, payments.error_queue, idle=IDLE)
    [copy] = [item.envelope for item in await dead_letters.peek(1)]
    await payments.store.ingest_all(dead_letters)
    # A broker that carries a lone surrogate: the row is what the ingester would store.
    headers = {**copy.headers, Header.MESSAGE_ID: "another", "x-note": "\ud800 half"}
    hostile = Envelope(headers, copy.body)
    store = payments.store
    async with store.engine.begin() as connection:
        row = store.row_of(DeadLetter(hostile), payments.error_queue)
        await connection.execute(store.table.insert(), [row])
    [group] = await store.groups()
    payments.broken = False

    retried = await store.retry_group(group.key)

    assert (retried.sent, retried.without_queue) == (2, [])
    await eventually(lambda: len(payments.handled) == 2, "both charges handled")
    assert payments.handled == ["o-1", "o-1"]


async def test_a_store_needs_an_app_with_a_database(memory_url: str) -> None:
    app = App("no-database", transport=memory_url)

    with pytest.raises(Exception, match=r"App\(database=\.\.\.\)"):
        DeadLetterStore.of(app)


# A crash at each step of ingesting a batch, on RabbitMQ and PostgreSQL.


class Crash(Exception):
    """The ingester dies here."""


def crash_before_insert(store: DeadLetterStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch was taken; nothing was written."""

    async def crash(*args: Any) -> int:
        raise Crash

    monkeypatch.setattr(store, "_insert", crash)


def crash_at_commit(store: DeadLetterStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows were inserted; the commit never happened."""

    def crash(*args: Any) -> None:
        raise Crash

    event.listen(store.engine.sync_engine, "commit", crash)
    monkeypatch.setattr(
        store, "_undo_crash", lambda: event.remove(store.engine.sync_engine, "commit", crash), False
    )


def crash_after_acks(count: int) -> Callable[[DeadLetterStore, pytest.MonkeyPatch], None]:
    """The rows committed; `count` of the batch were acked."""

    def arrange(store: DeadLetterStore, monkeypatch: pytest.MonkeyPatch) -> None:
        acked = 0
        ack = Held.ack

        async def crash(self: Held) -> None:
            nonlocal acked
            if acked == count:
                raise Crash
            acked += 1
            await ack(self)

        monkeypatch.setattr(Held, "ack", crash)

    return arrange


CRASHES = {
    "before the insert": crash_before_insert,
    "at the commit": crash_at_commit,
    "after the commit": crash_after_acks(0),
    "midway through the acks": crash_after_acks(2),
}


@pytest.mark.parametrize("where", sorted(CRASHES))
async def test_an_ingester_killed_at_any_step_stores_every_dead_letter_exactly_once(
    rabbit_payments: Payments, amqp_url: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    payments = rabbit_payments
    async for operator in started(RabbitMQTransport(amqp_url)):
        ids = await fail(payments, operator, "o-1", "o-2", "o-3", "o-4", "o-5")
    store = payments.store

    with monkeypatch.context() as patched:
        CRASHES[where](store, patched)
        async for dying in started(RabbitMQTransport(amqp_url)):
            with pytest.raises(Crash):
                await store.ingest(DeadLetters(dying, payments.error_queue, idle=IDLE))
        getattr(store, "_undo_crash", lambda: None)()

    async for restarted in started(RabbitMQTransport(amqp_url)):
        await store.ingest_all(DeadLetters(restarted, payments.error_queue, idle=IDLE))
        assert await error_count(restarted, payments.error_queue) == 0
    table = store.table
    async with store.engine.connect() as connection:
        stored = (
            await connection.execute(
                select(table.c.message_id, func.count()).group_by(table.c.message_id)
            )
        ).all()
    assert sorted(stored) == sorted((message_id, 1) for message_id in ids)


# The commands, on RabbitMQ and PostgreSQL.


async def test_the_commands_ingest_group_show_retry_and_delete(
    rabbit_payments: Payments,
    amqp_url: str,
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    payments = rabbit_payments
    async for operator in started(RabbitMQTransport(amqp_url)):
        ids = await fail(payments, operator, "o-1", "o-2", "o-3")
    target = ["--name", payments.app.name, "--database", postgres_url]
    broker = ["--transport", amqp_url, "--queue", payments.error_queue]

    async def run(*arguments: str) -> tuple[int, str]:
        capsys.readouterr()
        code = await mersal(*arguments)
        return code, capsys.readouterr().out

    assert await run("failures", "ingest", *target, *broker) == (
        0,
        f"stored 3 failure(s) from {payments.error_queue!r} of {mask(amqp_url)}\n",
    )
    code, groups = await run("failures", "groups", *target)
    assert code == 0
    [header, line] = groups.splitlines()
    assert header.split() == ["GROUP", "COUNT", "FIRST-SEEN", "LAST-SEEN", "FAILURE"]
    key, count = line.split()[:2]
    assert count == "3" and "card declined for order o-<n>" in line
    code, listed = await run("failures", "list", *target)
    assert sorted(row.split()[1] for row in listed.splitlines()[1:]) == sorted(ids)
    first = next(row.split()[0] for row in listed.splitlines()[1:] if ids[0] in row)
    code, shown = await run("failures", "show", first, *target)
    assert f"message-id: {ids[0]}" in shown and '"o-1"' in shown

    payments.broken = False
    assert await run("failures", "delete", first, *target) == (0, "deleted 1 failure(s)\n")
    code, retried = await run("failures", "retry", "--group", key, *target, *broker)
    assert (code, retried.splitlines()[0]) == (
        0,
        f"2 failure(s) queued in the outbox of app {payments.app.name!r}",
    )
    await eventually(lambda: sorted(payments.handled) == ["o-2", "o-3"], "the retried orders")
    assert await payments.store.count() == 0


async def test_the_commands_say_what_they_need(capsys: pytest.CaptureFixture[str]) -> None:
    assert await mersal("failures", "groups") == 2

    assert "needs --app module:app (an app with a database)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["groups", "--database", "postgresql://root@127.0.0.1:1/test"], "cannot use the database"),
        (["groups", "--database", "sqlite:////nowhere/x.db"], "there is no SQLite database"),
        (["retry", "--group", ""], "--group needs a group's key"),
        (["retry", "--group", "ffff"], "no group with a key starting 'ffff'"),
    ],
)
async def test_a_command_that_cannot_work_says_why_in_one_line(
    migrated_database: str, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    database = [] if "--database" in argv else ["--database", migrated_database]
    assert await mersal("failures", *argv, "--name", "billing", *database) == 2
    error = capsys.readouterr().err
    assert expected in error
    assert "Traceback" not in error


async def test_an_id_the_column_cannot_hold_is_refused_by_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        await mersal("failures", "show", "99999999999999999999", "--name", "billing")
    assert exited.value.code == 2
    assert "is not a failure's id" in capsys.readouterr().err


async def test_a_store_without_its_tables_names_the_upgrade(
    empty_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await mersal("failures", "list", "--name", "billing", "--database", empty_database) == 2
    assert "mersal db upgrade" in capsys.readouterr().err


async def test_retrying_or_deleting_an_unknown_id_names_it_and_exits_1(
    migrated_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for action in ("retry", "delete"):
        argv = ["failures", action, "424242", "--name", "billing", "--database", migrated_database]
        assert await mersal(*argv) == 1
        assert "no stored failure 424242 of app 'billing'" in capsys.readouterr().err
