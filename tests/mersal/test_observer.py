"""An observer hears of deliveries and outcomes, and can never cost a message anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mersal import App, ConfigurationError, MessageContext, RetryPolicy
from mersal.observer import Observer
from mersal.settle import Outcome
from mersal.testing import Harness


@dataclass
class Ping:
    n: int


class Decisions(Observer):
    """Overrides one report; the rest come from `Observer`."""

    def __init__(self) -> None:
        self.verdicts: list[str] = []

    def decided(self, context: MessageContext, outcome: Outcome) -> None:
        self.verdicts.append(outcome.verdict.value)


class OnlyDecided:
    """Duck-typed, but lacking most of the reports."""

    def decided(self, context: MessageContext, outcome: Outcome) -> None:
        pass


class Escape(BaseException):
    """Not an `Exception`: what a careless observer might raise."""


class Raising(Observer):
    """Every report raises, even an exception that is not an `Exception`."""

    def received(self, context: MessageContext) -> None:
        raise Escape

    def decided(self, context: MessageContext, outcome: Outcome) -> None:
        raise RuntimeError("observer broke")


def pinging(app: App, handled: list[int]) -> App:
    """Ping 1 is handled and sends Ping 2 to the app's own queue."""

    async def handle(message: Ping, context: MessageContext) -> None:
        handled.append(message.n)
        if message.n == 1:
            await context.app.send(Ping(2))

    app.register(Ping, handle)
    app.route(Ping, app.name)
    return app


def test_an_observer_lacking_reports_is_refused_naming_them() -> None:
    app = App("observed")

    with pytest.raises(ConfigurationError) as refused:
        app.observe(OnlyDecided())  # type: ignore[arg-type]

    assert str(refused.value) == (
        "app.observe(OnlyDecided): an observer needs received(), skipped_duplicate(), "
        "outbox_measured(), async send_each(): subclass mersal.observer.Observer, whose methods "
        "do nothing (and send_each just sends) until you override them"
    )


@pytest.mark.parametrize("database", [False, True], ids=["memory", "outbox"])
async def test_a_subclass_overriding_one_report_observes_and_sends(
    database: bool, memory_url: str, tmp_path: Path
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}" if database else None
    handled: list[int] = []
    app = pinging(App("observed", transport=memory_url, database=url), handled)
    observer = Decisions()
    app.observe(observer)

    async with Harness(app) as bus:
        await app.send(Ping(1))
        await bus.idle(10)

    assert handled == [1, 2]
    assert observer.verdicts == ["ack", "ack"]
    assert bus.dead_lettered == []


async def test_an_observer_that_raises_costs_the_message_nothing(memory_url: str) -> None:
    handled: list[int] = []
    app = pinging(
        App("observed", transport=memory_url, retry=RetryPolicy(immediate=0, delayed=())),
        handled,
    )
    app.observe(Raising())

    async with Harness(app) as bus:
        await app.send(Ping(1))
        await bus.idle(10)

    assert handled == [1, 2]
    assert bus.dead_lettered == []
