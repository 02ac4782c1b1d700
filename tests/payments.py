"""A payments app whose handler fails while the card service is broken: the dead-letter store's
and the dashboard's tests fill error queues with it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mersal import App, MessageContext, RetryPolicy, message
from mersal_sqlalchemy.dead_letters import DeadLetterStore, StoredFailure
from tests.support import eventually


@message("tests.payments.Charge.v1")
@dataclass
class Charge:
    """A command that fails while the card service is broken."""

    order_id: str


class CardDeclined(Exception):
    """The handler's failure, on purpose."""


@dataclass
class Payments:
    """The payments app, the orders its handler charged, and its dead-letter store."""

    app: App
    broken: bool = True
    handled: list[str] = field(default_factory=list)

    async def charge(self, command: Charge, context: MessageContext) -> None:
        """Fail while broken; record the order otherwise."""
        if self.broken:
            raise CardDeclined(f"card declined for order {command.order_id}")
        self.handled.append(command.order_id)

    async def fail(self, *order_ids: str, headers: dict[str, str] | None = None) -> list[str]:
        """Send charges (that fail while the handler is broken); their message ids."""
        return [await self.app.send(Charge(order), headers=headers) for order in order_ids]

    async def stored(self, count: int) -> list[StoredFailure]:
        """The store's failures, newest first, once it holds `count` of them."""

        async def enough() -> list[StoredFailure] | None:
            found = await self.store.page()
            return found if len(found) >= count else None

        return await eventually(enough, f"{count} failure(s) in the dead-letter store")

    @property
    def store(self) -> DeadLetterStore:
        """The app's dead-letter store."""
        return DeadLetterStore.of(self.app)

    @property
    def error_queue(self) -> str:
        """The app's error queue."""
        return self.app.retry.error_queue


async def running_payments(transport: str, database: str, prefix: str) -> AsyncIterator[Payments]:
    """A started payments app whose failures go straight to its own error queue."""
    retry = RetryPolicy(immediate=0, delayed=[], error_queue=f"{prefix}-error")
    app = App(f"{prefix}-payments", transport=transport, database=database, retry=retry)
    payments = Payments(app)
    app.register(Charge, payments.charge)
    app.route(Charge, app.name)
    async with app:
        yield payments
