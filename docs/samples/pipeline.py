"""The pipeline: a step of your own on the way in and one on the way out."""

from __future__ import annotations

import time
from dataclasses import dataclass

# --8<-- [start:imports]
from mersal import App, MessageContext, OutgoingContext
from mersal.pipeline import Next

# --8<-- [end:imports]
from mersal.testing import Harness


@dataclass
class Ping:
    n: int


# --8<-- [start:steps]
durations: list[float] = []


async def timed(context: MessageContext, next: Next[MessageContext]) -> None:
    started = time.perf_counter()
    await next(context)  # the rest of the chain: activate, dispatch, commit
    durations.append(time.perf_counter() - started)


async def tenant(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
    # before "serialize": part of the envelope
    context.headers.setdefault("tenant", "acme")
    await next(context)


def build_app(tenants: list[str]) -> App:
    app = App("pings")

    async def handle(message: Ping, context: MessageContext) -> None:
        tenants.append(context.headers["tenant"])

    app.register(Ping, handle)
    app.route(Ping, "pings")
    app.incoming.insert_after("decode", "timed", timed)
    app.outgoing.insert_before("serialize", "tenant", tenant)
    return app
    # --8<-- [end:steps]


async def main() -> tuple[list[str], list[str]]:
    """Send a Ping; return the incoming steps' names and the tenants seen."""
    tenants: list[str] = []
    app = build_app(tenants)
    async with Harness(app) as bus:
        await app.send(Ping(1))
        await bus.idle()
    return app.incoming.names, tenants
