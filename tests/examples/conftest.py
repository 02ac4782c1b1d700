"""Helpers for the examples' tests: in-process apps, `mersal run`, vhosts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI

ROOT = Path(__file__).parents[2]
MERSAL = Path(sys.executable).with_name("mersal")


# --8<-- [start:served]
@contextlib.asynccontextmanager
async def served(api: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client for `api`, its lifespan run around it (as a server would)."""
    async with api.router.lifespan_context(api):
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://shop"
        ) as client:
            yield client
            # --8<-- [end:served]


async def ready(url: str) -> bool:
    """Whether the probe at `url` answers 200."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(url)).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.asynccontextmanager
async def mersal_run(
    target: str, env: dict[str, str], port: int
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`mersal run TARGET`, probes on `port`; killed if it outlives the test."""
    process = await asyncio.create_subprocess_exec(
        str(MERSAL),
        "run",
        target,
        "--health-port",
        str(port),
        "--health-host",
        "127.0.0.1",
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
