"""`mersal run` as a production process: probes, JSON logs, waiting at start, clean failures.

Each test runs `python -m mersal.cli run svc:app` in a subprocess on a module written to the
test's directory; the app takes its broker and database from MERSAL_TRANSPORT and
MERSAL_DATABASE, as a deployed service does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

import aio_pika
import pytest

from mersal import App, MersalError, message
from mersal.cli.probes import prometheus_metrics
from mersal.cli.run import serve, stop_within
from mersal.errors import Unreachable
from mersal.starting import start_once
from tests.support import eventually, forwarding, free_port

pytestmark = pytest.mark.integration

SERVICE = """
from dataclasses import dataclass

from mersal import App, message


@message("run.Ping.v1")
@dataclass
class Ping:
    n: int


app = App("{name}")


async def handle(ping: Ping) -> None:
    return None


app.register(Ping, handle)
"""


@message("run.Ping.v1")
@dataclass
class Ping:
    n: int


@dataclass
class Run:
    """A `mersal run` subprocess and what it wrote to stderr."""

    process: asyncio.subprocess.Process
    lines: list[str]

    def json_lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]


def get(url: str) -> tuple[int, dict[str, object]]:
    """The status and JSON body of GET `url`."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get_text(url: str) -> tuple[int, str, str]:
    """The status, content type and text of GET `url`."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


@contextlib.asynccontextmanager
async def mersal_run(
    tmp_path: Path, name: str, env: dict[str, str], *options: str
) -> AsyncIterator[Run]:
    """Run `mersal run svc:app OPTIONS` on a service module named `name`; kill it if it lingers."""
    (tmp_path / "svc.py").write_text(SERVICE.format(name=name))
    async with running("svc:app", tmp_path, env, *options) as run:
        yield run


@contextlib.asynccontextmanager
async def running(
    target: str, cwd: Path, env: dict[str, str], *options: str, python: Sequence[str] = ()
) -> AsyncIterator[Run]:
    """Run `mersal run TARGET OPTIONS` in `cwd` (`python`: the interpreter's own options)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *python,
        "-m",
        "mersal.cli",
        "run",
        target,
        *options,
        cwd=cwd,
        env={**os.environ, **env, "PYTHONPATH": os.getcwd()},
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    run = Run(process, [])

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            run.lines.append(line.decode().rstrip("\n"))

    reader = asyncio.create_task(read())
    try:
        yield run
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await reader


async def ended(run: Run, timeout: float = 20.0) -> int:
    """The exit status, once the process has ended (and its stderr is read)."""
    async with asyncio.timeout(timeout):
        return await run.process.wait()


async def test_a_running_app_answers_its_probes_logs_json_lines_and_stops_on_sigterm(
    tmp_path: Path, amqp_url: str, postgres_url: str
) -> None:
    name = f"run-{uuid4().hex[:8]}"
    port = free_port()
    env = {"MERSAL_TRANSPORT": amqp_url, "MERSAL_DATABASE": postgres_url}
    options = ("--health-port", str(port), "--log-format", "json", "--log-messages")
    async with mersal_run(tmp_path, name, env, *options) as run:
        status, body = await eventually(
            lambda: _answered(f"http://127.0.0.1:{port}/readyz"), "ready", timeout=20
        )
        assert (status, body) == (200, {"ready": True, "checks": {}})
        assert get(f"http://127.0.0.1:{port}/livez") == (200, {"live": True, "checks": {}})

        sender = App(f"{name}-sender", transport=amqp_url)
        sender.route(Ping, name)
        try:
            async with sender:
                message_id = await sender.send(Ping(7))
            handled = await eventually(
                lambda: [e for e in run.json_lines() if e.get("logger") == "mersal.handled"],
                "a line for the handled message",
                timeout=10,
            )
        finally:
            await _delete_queues(amqp_url, f"{name}-sender")
        entry = handled[0]
        assert entry["level"] == "INFO"
        assert entry["message_id"] == message_id
        assert entry["message_type"] == "run.Ping.v1"
        assert entry["correlation_id"] == message_id
        assert entry["queue"] == name
        assert entry["attempt"] == 1
        assert isinstance(entry["duration_ms"], float)
        assert all(line.startswith("{") for line in run.lines), run.lines

        status, content_type, metrics = await asyncio.to_thread(
            get_text, f"http://127.0.0.1:{port}/metrics"
        )
        assert status == 200
        assert content_type.startswith("text/plain")
        processed = [
            line
            for line in metrics.splitlines()
            if line.startswith("messaging_process_duration_seconds_count")
        ]
        assert processed and float(processed[0].rsplit(" ", 1)[1]) == 1.0, metrics[:2000]

        run.process.send_signal(signal.SIGTERM)
        assert await ended(run) == 0
    await _delete_queues(amqp_url, name)


async def test_an_unreachable_broker_is_waited_for_then_one_line_and_exit_2(
    tmp_path: Path, postgres_url: str
) -> None:
    env = {"MERSAL_TRANSPORT": f"amqp://guest:secret@127.0.0.1:{free_port()}/"}
    async with mersal_run(tmp_path, "run-nobroker", env, "--wait", "1.5") as run:
        assert await ended(run) == 2
    assert not any("Traceback" in line for line in run.lines), run.lines
    waits = [line for line in run.lines if "trying again in" in line]
    assert waits and all("WARNING mersal.run" in line for line in waits)
    last = run.lines[-1]
    assert last.startswith("mersal: cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1")
    assert "(waited 1.5s; --wait SECONDS to wait longer)" in last
    assert all("secret" not in line for line in run.lines)


async def test_a_broker_that_comes_up_while_waited_for_is_used(
    tmp_path: Path, amqp_url: str
) -> None:
    port = free_port()
    vhost = amqp_url.rsplit("/", 1)[1]
    name = f"run-late-{uuid4().hex[:8]}"
    env = {"MERSAL_TRANSPORT": f"amqp://guest:guest@127.0.0.1:{port}/{vhost}"}
    health = free_port()
    async with mersal_run(tmp_path, name, env, "--wait", "30", "--health-port", str(health)) as run:
        await eventually(
            lambda: any("trying again in" in line for line in run.lines), "waiting", timeout=10
        )
        async with forwarding(port, 5672):
            status, _ = await eventually(
                lambda: _answered(f"http://127.0.0.1:{health}/readyz"), "ready", timeout=20
            )
            assert status == 200
            run.process.send_signal(signal.SIGTERM)
            assert await ended(run) == 0
    await _delete_queues(amqp_url, name)


async def test_an_unreachable_database_is_one_line_and_exit_2(
    tmp_path: Path, amqp_url: str
) -> None:
    env = {
        "MERSAL_TRANSPORT": amqp_url,
        "MERSAL_DATABASE": f"postgresql+asyncpg://root:hush@127.0.0.1:{free_port()}/nothing",
    }
    name = f"run-nodb-{uuid4().hex[:8]}"
    async with mersal_run(tmp_path, name, env, "--wait", "0") as run:
        assert await ended(run) == 2
    assert not any("Traceback" in line for line in run.lines), run.lines
    assert run.lines[-1].startswith("mersal: cannot connect to the database at postgresql")
    assert all("hush" not in line for line in run.lines)
    await _delete_queues(amqp_url, name)


async def test_a_health_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"MERSAL_TRANSPORT": f"memory://run-{uuid4().hex}"}
        options = ("--health-port", str(port), "--health-host", "127.0.0.1")
        async with mersal_run(tmp_path, "run-port", env, *options) as run:
            assert await ended(run) == 2
    assert run.lines[-1].startswith(
        f"mersal: cannot serve the health endpoints on 127.0.0.1:{port}"
    )
    assert "choose another --health-port" in run.lines[-1]


HANGING_STOP = '''
import asyncio

from mersal import App
from mersal.transport.memory import MemoryTransport


class HangingStop(MemoryTransport):
    """A memory transport whose stop never ends, as a broker that stopped answering."""

    async def stop(self) -> None:
        await asyncio.Event().wait()


app = App("run-hangs", transport=HangingStop("memory://run-hangs"))
'''


async def test_a_second_sigterm_ends_a_stop_that_hangs_at_once(tmp_path: Path) -> None:
    (tmp_path / "hangs.py").write_text(HANGING_STOP)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mersal.cli",
        "run",
        "hangs:app",
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        async with asyncio.timeout(20):
            async for line in process.stderr:
                if b"started on" in line:
                    break
            process.send_signal(signal.SIGTERM)
            async for line in process.stderr:
                if b"stopping gracefully" in line:
                    break
            process.send_signal(signal.SIGTERM)
            rest = (await process.stderr.read()).decode()
            assert await process.wait() == 128 + signal.SIGTERM
        assert "SIGTERM again: exiting at once" in rest
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_stop_that_outlasts_its_limit_is_abandoned(memory_url: str) -> None:
    app = App("run-stop-limit", transport=memory_url)
    async with asyncio.timeout(10):
        await app.start()
        app.transport.stop = _forever  # type: ignore[method-assign]
        assert await stop_within(app, 0.3) is False


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_a_start_whose_broker_takes_the_connection_but_never_answers_is_unreachable() -> None:
    reached = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.set()
        await reader.read()  # takes every byte, answers none, until the client leaves
        writer.close()

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    app = App("run-silent", transport=f"amqp://guest:guest@127.0.0.1:{port}/")
    try:
        async with asyncio.timeout(10):
            with pytest.raises(Unreachable, match=r"could not start within 0\.5s"):
                await start_once(app, 0.5, asyncio.Event())
            stopping = asyncio.Event()
            attempt = asyncio.create_task(start_once(app, 30, stopping))
            reached.clear()
            await reached.wait()  # the attempt is connected to the silent broker
            stopping.set()
            assert await attempt is False
        assert not app.running
    finally:
        silent.close()


async def test_serve_ends_with_1_when_the_app_stops_working_on_its_own() -> None:
    app = App("run-dies", transport=f"memory://run-{uuid4().hex}")
    app.register(Ping, _ignore)
    served = asyncio.create_task(serve(app))
    await eventually(lambda: app.worker is not None, "started")
    assert app.worker is not None
    await app.worker.consumer.close()  # as if the broker lost it for good
    async with asyncio.timeout(10):
        assert await served == 1
    assert not app.running


async def test_without_the_prometheus_extra_metrics_answers_404_saying_what_serves_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    app = App("run-no-metrics", transport=f"memory://run-{uuid4().hex}")
    app.register(Ping, _ignore)
    metrics = prometheus_metrics(app)
    assert metrics is None
    port = free_port()
    caplog.set_level(logging.INFO, logger="mersal.probes")
    served = asyncio.create_task(serve(app, health_port=port, health_host="127.0.0.1"))
    try:
        livez = f"http://127.0.0.1:{port}/livez"
        await eventually(lambda: asyncio.to_thread(_answered, livez), "serving")
        with pytest.raises(urllib.error.HTTPError) as answer:
            await asyncio.to_thread(get_text, f"http://127.0.0.1:{port}/metrics")
        assert answer.value.code == 404
        assert "pip install 'mersal-bus[prometheus]'" in answer.value.read().decode()
    finally:
        served.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await served
        await app.stop()
    started = [r.getMessage() for r in caplog.records if r.name == "mersal.probes"]
    assert any("no /metrics" in line and "mersal-bus[prometheus]" in line for line in started)


def test_concurrency_is_set_before_start_and_the_prefetch_follows() -> None:
    app = App("run-concurrency", transport=f"memory://run-{uuid4().hex}", concurrency=4)
    app.set_concurrency(50)
    assert (app.settings.concurrency, app.settings.prefetch) == (
        50,
        App("run-same", concurrency=50).settings.prefetch,
    )
    with pytest.raises(MersalError, match="must be an int >= 1"):
        app.set_concurrency(0)


async def _ignore(ping: Ping) -> None:
    return None


def _answered(url: str) -> tuple[int, dict[str, object]] | None:
    try:
        return get(url)
    except OSError:
        return None


async def _delete_queues(url: str, name: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(name)
    finally:
        await connection.close()


async def test_an_async_factory_is_awaited_in_the_serving_loop_and_a_stop_says_how_it_went(
    tmp_path: Path, async_factory: Callable[[str], str]
) -> None:
    name = f"run-{uuid4().hex[:8]}"
    target = async_factory(name)
    options = ("-W", "error::RuntimeWarning")
    async with running(target, tmp_path, {}, python=options) as run:
        await eventually(
            lambda: any(f"app '{name}' started on memory://" in line for line in run.lines),
            "the app started",
            timeout=20,
        )
        run.process.send_signal(signal.SIGTERM)
        assert await ended(run) == 0, run.lines
    messages = [line.split(" ", 4)[-1] for line in run.lines]
    assert f"stopping app '{name}': nothing in flight" in messages, run.lines
    assert f"app '{name}' stopped in 0.0 s" in messages, run.lines
    assert not [line for line in run.lines if "never awaited" in line or "Warning" in line]


@pytest.mark.parametrize(
    "source, target, said",
    [
        ("raise RuntimeError('no config')", "boom:app", "importing 'boom' raised RuntimeError: no"),
        (
            "def make():\n    return {}['missing']\n",
            "boom:make",
            "boom:make() raised KeyError: 'missing'",
        ),
        (
            "async def make():\n    return {}['missing']\n",
            "boom:make",
            "boom:make() raised KeyError: 'missing'",
        ),
        (
            "async def make():\n    return 42\n",
            "boom:make",
            "boom:make() returned int, not a mersal App: name an App, or a function (async or "
            "not) that returns one",
        ),
        (
            "app = 'orders'\n",
            "boom:app",
            "boom:app is str, not a mersal App: name an App, or a function (async or not) that "
            "returns one",
        ),
        (
            "app = None\n",
            "boom:app",
            "boom:app is NoneType, not a mersal App: name an App, or a function (async or not) "
            "that returns one",
        ),
        (
            "async def inner():\n    return 1\nasync def make():\n    return inner()\n",
            "boom:make",
            "boom:make() returned coroutine, not a mersal App: name an App, or a function (async "
            "or not) that returns one",
        ),
        ("class Holder:\n    app = None\n", "boom:Holder.nope", "module 'boom' has no attribute"),
    ],
)
def test_a_module_that_fails_to_load_is_one_line_and_exit_2(
    source: str, target: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "boom.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "boom", raising=False)
    result = subprocess.run(
        [sys.executable, "-m", "mersal.cli", "run", target],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"mersal: {said}")
    assert "Traceback" not in result.stderr
    assert "never awaited" not in result.stderr
