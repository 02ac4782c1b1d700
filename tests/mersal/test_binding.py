"""A newcomer's mistakes: each error or warning quotes what to change."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.support import eventually

# 1. A session without a database.


# 2. Types that are not messages.


# 3. Messages that cannot be encoded.


# 5. Handled types that nothing this app configures delivers.


# 7. memory:// in `mersal run`.

MEMORY_SERVICE = """
from dataclasses import dataclass

from mersal import App


@dataclass
class Ping:
    n: int


async def handle(ping: Ping) -> None:
    return None


app = App("lonely", transport="memory://lonely")
app.register(Ping, handle)
app.route(Ping, "lonely")
"""


async def test_mersal_run_on_memory_warns_that_no_other_process_reaches_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "svc.py").write_text(MEMORY_SERVICE)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MERSAL_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mersal.cli",
        "run",
        "svc:app",
        cwd=tmp_path,
        env={**environment, "PYTHONPATH": os.getcwd()},
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    lines: list[str] = []

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            lines.append(line.decode().rstrip("\n"))

    reader = asyncio.create_task(read())
    try:
        await eventually(lambda: any("started" in line for line in lines), "started", timeout=20)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await reader
    warned = [line.split(": ", 1)[1] for line in lines if "WARNING mersal.run" in line]
    assert warned == [
        "app 'lonely' runs on memory://lonely, a broker inside this process: no other process "
        "reaches it (a second `mersal run`, a web server or a script on the same URL gets an "
        "empty broker of its own, and their messages never meet); for several processes use "
        "RabbitMQ: MERSAL_TRANSPORT=amqp://user:password@host/vhost"
    ]
