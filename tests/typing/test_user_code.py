"""A user's code type-checks against the installed packages: mypy catches wrong handlers."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = """
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, MessageContext
from mersal.testing import Harness
from mersal_rabbitmq import RabbitMQTransport
from mersal_sqlalchemy import attach


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class CancelOrder:
    order_id: str


class PlaceOrderHandler:
    def __init__(self, app: App, session: AsyncSession) -> None:
        self.app, self.session = app, session

    async def __call__(self, message: PlaceOrder) -> None:
        await self.app.publish(message)


async def place(message: PlaceOrder) -> None:
    print(message.order_id)


async def place_in_context(message: PlaceOrder, context: MessageContext) -> None:
    print(context.message_id)


async def context_first(context: MessageContext, message: PlaceOrder) -> None:
    print(context.message_id, message.order_id)


async def anything(message: object) -> None:
    print(message)


def place_now(message: PlaceOrder) -> None:
    print(message)


app = App("orders")
"""

GOOD = """
app.register(PlaceOrder, PlaceOrderHandler)
app.register(PlaceOrder, place)
app.register(PlaceOrder, place_in_context)
app.register(PlaceOrder, context_first)
app.register(PlaceOrder, anything)


async def check(bus: Harness) -> str:
    orders: list[PlaceOrder] = bus.published_of(PlaceOrder) + bus.sent_of(PlaceOrder)
    reply: CancelOrder = await app.request(PlaceOrder("1"), reply_type=CancelOrder)
    untyped = await app.request(PlaceOrder("2"))  # no reply_type: whatever comes back
    print(untyped.order_id)
    transport = RabbitMQTransport("amqp://guest:guest@127.0.0.1/")
    print(transport, attach)
    return orders[0].order_id + reply.order_id
"""

BAD = {
    "a handler class for another type": "app.register(CancelOrder, PlaceOrderHandler)",
    "a function for another type": "app.register(CancelOrder, place)",
    "a context-first function for another type": "app.register(CancelOrder, context_first)",
    "a function that is not async": "app.register(PlaceOrder, place_now)",
    "a published message read as another type": (
        "def read(bus: Harness) -> CancelOrder:\n    return bus.published_of(PlaceOrder)[0]"
    ),
    "a reply read as another type": (
        "async def ask() -> PlaceOrder:\n"
        "    return await app.request(PlaceOrder('1'), reply_type=CancelOrder)"
    ),
}


def mypy_strict(tmp_path: Path) -> tuple[dict[str, range], dict[int, str]]:
    """mypy --strict over one user module holding the good code and every mistake.

    Run outside the checkout, as a user's project would: (lines of each mistake, errors by line).
    One run for all of them: each run of mypy costs a cold cache's twenty seconds.
    """
    lines = textwrap.dedent(PRELUDE).splitlines() + textwrap.dedent(GOOD).splitlines()
    spans = {}
    for mistake, code in BAD.items():
        lines.append("")
        start = len(lines) + 1
        lines.extend(code.splitlines())
        spans[mistake] = range(start, len(lines) + 1)
    (tmp_path / "user_app.py").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "user_app.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = {}
    for line in result.stdout.splitlines():
        found = re.match(r"user_app\.py:(\d+): error: (.*)", line)
        if found:
            errors[int(found.group(1))] = found.group(2)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return spans, errors


def test_mypy_strict_passes_the_correct_code_and_catches_every_mistake(tmp_path: Path) -> None:
    spans, errors = mypy_strict(tmp_path)
    in_mistakes = {line for span in spans.values() for line in span}
    assert {line: text for line, text in errors.items() if line not in in_mistakes} == {}
    missed = [mistake for mistake, span in spans.items() if not any(n in errors for n in span)]
    assert missed == [], f"mypy let these pass: {missed}"
