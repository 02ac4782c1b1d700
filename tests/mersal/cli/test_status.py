"""`mersal status` end to end: RabbitMQ (a vhost per test), PostgreSQL and SQLite, in-process.

Unacked counts come from RabbitMQ's management API, which refreshes them every 5 s: the tests
that read them wait for the expected value, with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import aio_pika
import aiormq
import pytest
from sqlalchemy import insert, inspect

from mersal import Header
from mersal.cli import load_app
from mersal.dead_letters import DeadLetter
from mersal.messages import Envelope
from mersal_sqlalchemy.cli import upgrade
from mersal_sqlalchemy.dead_letters import DeadLetterStore
from mersal_sqlalchemy.engines import database_url, make_engine, sql_time
from mersal_sqlalchemy.tables import make_tables
from tests.support import (
    BACKENDS,
    eventually,
    mersal,
    postgres_database,
    rabbitmqctl_rows,
    sqlite_file,
)

UNACKED_WAIT = 30.0
"""Seconds to wait for the management API's counts (it refreshes them every 5 s)."""

JSON_KEYS = {
    "app",
    "exit_code",
    "reasons",
    "broker",
    "queues",
    "unacked_note",
    "database",
    "outbox",
    "failures",
    "inbox",
}
APP_MODULE = """
from mersal import App, RetryPolicy



def make_app() -> App:
    retry = RetryPolicy(immediate=0, delayed=[0.5], error_queue={error!r})
    return App({name!r}, transport={transport!r}, database={database!r}, retry=retry)
"""
"""The module `--app` names in the tests: `make_app` returns a new App each time."""

QUEUE_KEYS = {"name", "role", "exists", "ready", "unacked", "consumers", "wait_of"}


@dataclass
class Run:
    """One `mersal status` run: exit code, stdout, stderr lines."""

    code: int
    out: str
    err: list[str]

    @property
    def report(self) -> dict[str, Any]:
        """The stdout of a `--json` run."""
        report: dict[str, Any] = json.loads(self.out)
        return report

    def queue(self, name: str) -> dict[str, Any]:
        """The JSON entry of queue `name`."""
        found: list[dict[str, Any]] = [q for q in self.report["queues"] if q["name"] == name]
        assert len(found) == 1, self.report["queues"]
        return found[0]


Status = Callable[..., Awaitable[Run]]


@pytest.fixture
def status(capsys: pytest.CaptureFixture[str]) -> Status:
    """`await status(*argv)`: run `mersal status ARGV` in this process, return what it said."""

    async def run(*argv: str) -> Run:
        code = await mersal("status", *argv)
        out, err = capsys.readouterr()
        return Run(code, out, err.splitlines())

    return run


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """`app_module(name, transport, database)`: a module defining `make_app`; its --app target."""
    written: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, transport: str, database: str | None) -> str:
        module = f"status_app_{uuid4().hex[:8]}"
        source = APP_MODULE.format(
            name=name, error=f"{name}.error", transport=transport, database=database
        )
        (tmp_path / f"{module}.py").write_text(source)
        written.append(module)
        return f"{module}:make_app"

    yield write
    for module in written:
        sys.modules.pop(module, None)


async def declare(url: str, *queues: str) -> None:
    """Declare durable classic queues, as an app would."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for queue in queues:
            await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "classic"})


async def put(url: str, queue: str, count: int) -> None:
    """Publish `count` messages to `queue` through the default exchange, confirmed."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for number in range(count):
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % number), queue)


async def exists(url: str, queue: str) -> bool:
    """Whether `queue` exists, by passive declaration."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True


async def add_rows(database: str, app: str, *, pending: int, parked: int, age: float) -> None:
    """Outbox rows of `app` (pending ones `age` seconds old, parked ones), and inbox rows."""
    engine = make_engine(database)
    tables = make_tables()
    row = {"app": app, "address": "billing", "publish": False, "headers": "{}", "body": b"{}"}
    try:
        async with engine.begin() as connection:
            for _ in range(pending):
                statement = insert(tables.outbox).values(created_at=sql_time(engine, -age))
                await connection.execute(statement, row)
            for _ in range(parked):
                statement = insert(tables.outbox).values(
                    parked_at=sql_time(engine), parked_reason="Unroutable: no queue 'billing'"
                )
                await connection.execute(statement, row)
            for number in range(pending + parked):
                message_id = f"{app}-{number}"
                await connection.execute(
                    insert(tables.inbox), {"app": app, "message_id": message_id}
                )
    finally:
        await engine.dispose()


@pytest.mark.integration
async def test_a_healthy_app_shows_its_queues_counts_and_exits_0(
    status: Status, own_vhost: str, postgres_url: str, app_module: Callable[..., str]
) -> None:
    name = "orders"
    target = app_module(name, own_vhost, postgres_url)
    async with load_app(target):
        pass  # declares the app's input and error queues, as `mersal run` would
    await declare(own_vhost, f"{name}.wait.500", f"{name}.wait.7000")
    await put(own_vhost, f"{name}.wait.7000", 1)
    await put(own_vhost, name, 5)
    await add_rows(postgres_url, "billing", pending=2, parked=1, age=1.0)  # another app's rows
    await add_rows(postgres_url, name, pending=1, parked=0, age=0.0)
    async with AsyncExitStack() as stack:
        connection = await stack.enter_async_context(await aio_pika.connect(own_vhost))
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def hold(delivery: aio_pika.abc.AbstractIncomingMessage) -> None:
            held.append(delivery)  # never acked: two held, three ready

        queue = await channel.get_queue(name, ensure=False)
        await queue.consume(hold)
        await eventually(lambda: len(held) == 2, "the consumer holding two messages")

        async def counted() -> Run | None:
            run = await status("--app", target, "--json")
            unacked = [queue["unacked"] for queue in run.report["queues"]]
            return run if unacked == [2, 0, 0, 0] else None

        run = await eventually(
            counted, "unacked counts from the management API", timeout=UNACKED_WAIT, interval=0.5
        )
        assert run is not None

        assert run.code == 0, run.err
        assert run.err == []
        report = run.report
        assert set(report) == JSON_KEYS
        assert report["app"] == name
        assert report["exit_code"] == 0
        assert report["reasons"] == []
        assert report["broker"] == own_vhost.replace("guest:guest", "guest:***")
        assert report["unacked_note"] is None
        assert [(q["name"], q["role"]) for q in report["queues"]] == [
            (name, "input"),
            (f"{name}.error", "error"),
            (f"{name}.wait.500", "wait"),
            (f"{name}.wait.7000", "wait"),
        ]
        assert all(set(queue) == QUEUE_KEYS for queue in report["queues"])
        assert run.queue(name) | {"unacked": 2} == {
            "name": name,
            "role": "input",
            "exists": True,
            "ready": 3,
            "unacked": 2,
            "consumers": 1,
            "wait_of": None,
        }
        assert (run.queue(f"{name}.error")["ready"], run.queue(f"{name}.error")["consumers"]) == (
            0,
            0,
        )
        assert run.queue(f"{name}.wait.7000")["ready"] == 1
        assert run.queue(f"{name}.wait.7000")["wait_of"] == name
        assert report["database"] == postgres_url
        assert report["outbox"]["app"] == name
        assert (report["outbox"]["pending"], report["outbox"]["parked"]) == (1, 0)
        assert 0 <= report["outbox"]["oldest_pending_age"] < 60
        assert report["inbox"] == {"app": name, "rows": 1}

        text = await status("--app", target)
        assert text.code == 0
        lines = text.out.splitlines()
        assert lines[0] == f"app {name!r}"
        assert lines[-1] == "ok: nothing needs an operator"
        assert [line.split() for line in lines if line.startswith(f"{name} ")] == [
            [name, "input", "3", "2", "1"]
        ]
        assert "outbox: 1 pending (the oldest " in text.out
        assert "inbox: 1 row(s)" in text.out


@pytest.mark.integration
async def test_messages_in_the_error_queue_need_an_operator(status: Status, own_vhost: str) -> None:
    await declare(own_vhost, "payments", "payments.error")
    await put(own_vhost, "payments.error", 2)

    run = await status(
        "--transport", own_vhost, "--queue", "payments", "--error-queue", "payments.error"
    )

    assert run.code == 1
    assert len(run.err) == 1
    assert run.err[0].startswith("mersal: 2 message(s) in the error queue 'payments.error'")
    assert "mersal dlq list --queue payments.error --transport " in run.err[0]
    assert "guest:guest" not in run.out + run.err[0]
    rows = [line.split() for line in run.out.splitlines() if line.startswith("payments")]
    assert [row[:3] for row in rows] == [
        ["payments", "queue", "0"],
        ["payments.error", "error", "2"],
    ]
    assert "ok: nothing needs an operator" not in run.out


async def migrated(stack: AsyncExitStack, backend: str, tmp_path: Path) -> str:
    """A migrated database on `backend`, dropped when `stack` closes (PostgreSQL)."""
    if backend == "sqlite":
        database = sqlite_file(tmp_path)
        await asyncio.to_thread(upgrade, database)
        return database
    return await stack.enter_async_context(postgres_database(migrate=True))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_parked_rows_need_an_operator_and_pending_rows_show_their_age(
    status: Status, backend: str, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        database = await migrated(stack, backend, tmp_path)
        await add_rows(database, "orders", pending=2, parked=1, age=30.0)
        await add_rows(database, "billing", pending=1, parked=0, age=5.0)

        run = await status("--database", database, "--json")

        assert run.code == 1
        report = run.report
        assert report["exit_code"] == 1
        assert report["broker"] is None and report["queues"] == []
        outbox = report["outbox"]
        assert (outbox["app"], outbox["pending"], outbox["parked"]) == (None, 3, 1)
        assert 29 <= outbox["oldest_pending_age"] < 120
        assert report["inbox"] == {"app": None, "rows": 4}
        assert len(report["reasons"]) == 1
        assert report["reasons"][0].startswith("1 parked outbox row(s)")
        assert run.err == [f"mersal: {report['reasons'][0]}"]
        argv = suggested(run.err[0], "outbox list")
        assert argv == ["--parked", "--database", database]
        assert await mersal("outbox", "list", *argv) == 1  # 1: parked rows need an operator


@pytest.mark.parametrize("backend", BACKENDS)
async def test_failures_in_the_dead_letter_store_need_an_operator(
    status: Status, backend: str, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        database = await migrated(stack, backend, tmp_path)
        engine = make_engine(database_url(database))
        store = DeadLetterStore(engine, make_tables(), "orders")
        letter = DeadLetter(Envelope({Header.ERROR_TYPE: "Boom"}, b"{}"))
        retried = DeadLetter(Envelope({Header.ERROR_TYPE: "Boom", "n": "2"}, b"{}"))
        async with engine.begin() as connection:
            rows = [store.row_of(one, "error") for one in (letter, retried)]
            await connection.execute(store.table.insert(), rows)
        [_, tombstone] = sorted(failure.id for failure in await store.page())
        await store.delete([tombstone])  # a tombstone now: no failure to count
        await engine.dispose()

        run = await status("--database", database, "--json")

    assert run.code == 1
    assert run.report["failures"] == 1
    [reason] = run.report["reasons"]
    assert reason.startswith("1 failed message(s) in the dead-letter store")
    assert "`mersal failures groups --name APP --database " in reason


async def test_without_an_app_or_urls_it_says_what_to_pass(
    status: Status, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)

    run = await status()

    assert run.code == 2
    assert run.out == ""
    assert len(run.err) == 1
    for option in ("--app module:app", "--transport URL", "--database URL", "MERSAL_TRANSPORT"):
        assert option in run.err[0]

    without_queues = await status("--transport", "amqp://guest:s3cret@127.0.0.1/vh")
    assert without_queues.code == 2
    assert len(without_queues.err) == 1 and "--queue NAME" in without_queues.err[0]
    assert "s3cret" not in without_queues.err[0]


async def test_an_in_process_broker_is_refused(
    status: Status, app_module: Callable[..., str]
) -> None:
    run = await status("--app", app_module("orders", "memory://status", None))

    assert run.code == 2
    assert len(run.err) == 1
    assert "in-process broker" in run.err[0] and "--transport amqp://" in run.err[0]


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        pytest.param(
            ("--transport", "amqp://guest:s3cret@127.0.0.1:1/vh", "--queue", "orders"),
            "mersal: cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:1/vh",
            id="broker",
        ),
        pytest.param(
            ("--database", "postgresql+asyncpg://root:s3cret@127.0.0.1:1/orders"),
            "mersal: cannot look at the database postgresql+asyncpg://root:***@",
            id="database",
        ),
    ],
)
async def test_an_unreachable_broker_or_database_is_one_line_with_the_password_masked(
    status: Status, arguments: tuple[str, ...], said: str
) -> None:
    run = await status(*arguments)

    assert run.code == 2
    assert run.out == ""
    assert len(run.err) == 1, run.err
    assert run.err[0].startswith(said)
    assert "s3cret" not in run.err[0]


async def test_a_broker_that_does_not_answer_is_given_up_on_after_the_timeout(
    status: Status,
) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts the connection, never says a word of AMQP

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        started = time.monotonic()
        run = await status(
            "--transport",
            f"amqp://guest:s3cret@127.0.0.1:{port}/",
            "--queue",
            "q",
            "--timeout",
            "1",
        )
        elapsed = time.monotonic() - started

    assert run.code == 2
    assert run.err == [
        f"mersal: no answer within 1s from amqp://guest:***@127.0.0.1:{port}/: is it up? "
        "(--timeout SECONDS to wait longer)"
    ]
    assert elapsed < 10


@pytest.mark.parametrize("backend", BACKENDS)
async def test_missing_tables_say_mersal_db_upgrade_and_are_not_created(
    status: Status, backend: str, tmp_path: Path
) -> None:
    async with AsyncExitStack() as stack:
        if backend == "sqlite":
            database = sqlite_file(tmp_path)
        else:
            database = await stack.enter_async_context(postgres_database(migrate=False))

        run = await status("--database", database)

        assert run.code == 2
        assert run.out == ""
        assert len(run.err) == 1
        assert f"mersal db upgrade --database '{database}'" in run.err[0]
        if backend == "sqlite":
            assert not (tmp_path / "app.db").exists()
            return
        engine = make_engine(database)
        try:
            async with engine.connect() as connection:
                names = await connection.run_sync(lambda sync: inspect(sync).get_table_names())
        finally:
            await engine.dispose()
        assert names == []


@pytest.mark.integration
async def test_a_queue_that_does_not_exist_is_named_and_nothing_is_declared(
    status: Status, own_vhost: str
) -> None:
    await declare(own_vhost, "orders")

    run = await status("--transport", own_vhost, "--queue", "orders", "--queue", "ghost", "--json")

    assert run.code == 2
    assert run.queue("orders")["exists"] is True
    assert run.queue("ghost") == {
        "name": "ghost",
        "role": "queue",
        "exists": False,
        "ready": None,
        "unacked": None,
        "consumers": None,
        "wait_of": None,
    }
    assert run.err == [f"mersal: {run.report['reasons'][0]}"]
    assert "no queue 'ghost'" in run.err[0] and "check the name" in run.err[0]
    assert not await exists(own_vhost, "ghost")
    vhost = own_vhost.rpartition("/")[2]
    exchanges = {row["name"] for row in rabbitmqctl_rows("list_exchanges", "-p", vhost, "name")}
    assert "mersal.events" not in exchanges


@pytest.mark.integration
async def test_without_the_management_api_unacked_is_unknown_and_it_says_how_once(
    status: Status, own_vhost: str
) -> None:
    await declare(own_vhost, "orders", "orders.error")
    elsewhere = ("--management", "http://127.0.0.1:1")
    queues = ("--queue", "orders", "--error-queue", "orders.error")

    text = await status("--transport", own_vhost, *queues, *elsewhere)
    run = await status("--transport", own_vhost, *queues, *elsewhere, "--json")

    assert (text.code, run.code) == (0, 0)
    rows = [line.split() for line in text.out.splitlines() if line.startswith("orders")]
    assert rows == [["orders", "queue", "0", "?", "0"], ["orders.error", "error", "0", "?", "0"]]
    hints = [line for line in text.out.splitlines() if "rabbitmq_management" in line]
    assert len(hints) == 1 and "--management URL" in hints[0]
    assert [queue["unacked"] for queue in run.report["queues"]] == [None, None]
    assert "rabbitmq-plugins enable rabbitmq_management" in run.report["unacked_note"]


def suggested(reason: str, command: str) -> list[str]:
    """The arguments of the `mersal COMMAND ...` a reason suggests, as a shell would split them."""
    found = re.search(rf"`mersal {command} ([^`]*)`", reason)
    assert found is not None, reason
    return shlex.split(found.group(1))


@pytest.mark.integration
async def test_the_dlq_command_suggested_for_an_app_works_as_printed(
    status: Status,
    own_vhost: str,
    app_module: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "refunds"
    target = app_module(name, own_vhost, None)
    async with load_app(target):
        pass  # declares the app's input and error queues
    await put(own_vhost, f"{name}.error", 2)

    run = await status("--app", target)

    assert run.code == 1
    argv = suggested(run.err[0], "dlq list")
    assert argv[:2] == ["--app", target]
    assert "***" not in argv and "--transport" not in argv
    assert await mersal("dlq", "list", *argv) == 0
    assert f"2 message(s) in '{name}.error'" in capsys.readouterr().out


@pytest.mark.integration
async def test_suggested_commands_show_no_password_and_say_to_add_it(
    status: Status, own_vhost: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await declare(own_vhost, "invoices", "invoices.error")
    await put(own_vhost, "invoices.error", 1)
    queues = ("--queue", "invoices", "--error-queue", "invoices.error")

    run = await status("--transport", own_vhost, *queues)

    assert run.code == 1
    argv = suggested(run.err[0], "dlq list")
    without = own_vhost.replace("guest:guest@", "guest@")
    assert argv == ["--queue", "invoices.error", "--transport", without]
    assert "add the password" in run.err[0] and "MERSAL_TRANSPORT" in run.err[0]
    assert "***" not in run.err[0] and "guest:guest" not in run.err[0]

    monkeypatch.setenv("MERSAL_TRANSPORT", own_vhost)
    from_environment = await status(*queues)

    assert suggested(from_environment.err[0], "dlq list") == ["--queue", "invoices.error"]
    assert await mersal("dlq", "list", "--queue", "invoices.error") == 0


SHARED_MODULE = """
from mersal import App


async def make_app() -> App:
    return App({name!r}, transport={transport!r}, database={database!r})


def make_sender() -> App:
    return App({sender!r}, transport={transport!r}, database={database!r}, consume=False)
"""
"""A consuming app (made by an async function) and a send-only app sharing one database."""

OLDEST = re.compile(r"\d+\.\ds")


@pytest.mark.integration
async def test_every_app_sharing_the_outbox_is_shown_with_the_one_asked_for_marked(
    status: Status,
    own_vhost: str,
    migrated_database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = migrated_database
    module = f"shared_{uuid4().hex[:8]}"
    source = SHARED_MODULE.format(
        name="orders", sender="orders-web", transport=own_vhost, database=database
    )
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    await declare(own_vhost, "orders", "error")
    await add_rows(database, "orders", pending=1, parked=0, age=0.0)
    await add_rows(database, "orders-web", pending=2, parked=1, age=30.0)

    consumer = await status("--app", f"{module}:make_app", "--json")
    sender = await status("--app", f"{module}:make_sender", "--json")
    text = await status("--app", f"{module}:make_app")

    assert consumer.code == 0, consumer.err  # the send-only app's parked row is its own problem
    outbox = consumer.report["outbox"]
    assert (outbox["app"], outbox["pending"], outbox["parked"]) == ("orders", 1, 0)
    ages = [rows.pop("oldest_pending_age") for rows in outbox["apps"]]
    assert outbox["apps"] == [
        {"app": "orders", "pending": 1, "parked": 0, "selected": True},
        {"app": "orders-web", "pending": 2, "parked": 1, "selected": False},
    ]
    assert 0 <= ages[0] < 60 and 29 <= ages[1] < 120

    assert sender.code == 1
    assert sender.report["reasons"][0].startswith("1 parked outbox row(s) of app 'orders-web'")
    outbox = sender.report["outbox"]
    assert (outbox["app"], outbox["pending"], outbox["parked"]) == ("orders-web", 2, 1)
    assert [(rows["app"], rows["selected"]) for rows in outbox["apps"]] == [
        ("orders", False),
        ("orders-web", True),
    ]

    assert text.code == 0
    lines = text.out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("outbox: ")))
    assert [OLDEST.sub("N.Ns", line) for line in lines[start : start + 5]] == [
        "outbox: 1 pending (the oldest N.Ns old), 0 parked",
        "  APP         PENDING  PARKED  OLDEST PENDING",
        "* orders      1        0       N.Ns",
        "  orders-web  2        1       N.Ns",
        "  (* is app 'orders': the outbox line above and the exit status count its rows only)",
    ]
