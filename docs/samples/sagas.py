"""Sagas: an invoice chased until it is paid, and a batch counted from many
messages."""

from __future__ import annotations

# --8<-- [start:messages]
from dataclasses import dataclass
from datetime import timedelta

from mersal import App, RetryPolicy, message
from mersal.sagas import Saga
from mersal.testing import DeadLetter, Harness


@message("billing.InvoiceIssued.v1")
@dataclass
class InvoiceIssued:
    invoice_id: str
    customer: str
    amount: float


@message("bank.PaymentReceived.v1")
@dataclass
class PaymentReceived:
    reference: (
        str  # what the customer wrote on the transfer: "INV-<invoice id>"
    )
    amount: float


@message("billing.InvoiceCancelled.v1")
@dataclass
class InvoiceCancelled:
    invoice_id: str


@message("billing.PaymentDue.v1")
@dataclass
class PaymentDue:  # the saga's timeout: it sends it to itself
    reminder: int


@message("billing.ReminderDue.v1")
@dataclass
class ReminderDue:
    invoice_id: str
    customer: str
    reminder: int


@message("billing.InvoiceOverdue.v1")
@dataclass
class InvoiceOverdue:
    invoice_id: str
    # --8<-- [end:messages]


class UnmatchedPayment(Exception):
    """A payment that no open invoice waits for."""


# --8<-- [start:saga]
@dataclass
# the saga's data: a dataclass, a pydantic model or a msgspec Struct
class Invoice:
    invoice_id: str
    customer: str
    amount: float
    paid: float = 0.0
    reminders: int = 0


class InvoiceCollection(Saga[Invoice], name="billing.InvoiceCollection"):
    started_by = (InvoiceIssued,)
    correlation = {
        InvoiceIssued: "invoice_id",  # an attribute of the message
        InvoiceCancelled: "invoice_id",
        # a function
        PaymentReceived: lambda paid: paid.reference.removeprefix("INV-"),
    }

    # injected like a handler class's arguments
    def __init__(self, app: App) -> None:
        self.app = app

    # Invoice has required fields
    def new_data(self, message: InvoiceIssued) -> Invoice:
        return Invoice(message.invoice_id, message.customer, message.amount)

    async def issued(self, event: InvoiceIssued) -> None:
        await self.request_timeout(timedelta(days=14), PaymentDue(reminder=1))

    async def paid(self, event: PaymentReceived) -> None:
        self.data.paid += event.amount
        if self.data.paid >= self.data.amount:
            # the saga's row is deleted when this message commits
            self.mark_complete()

    async def cancelled(self, event: InvoiceCancelled) -> None:
        self.mark_complete()

    async def due(self, timeout: PaymentDue) -> None:
        if timeout.reminder > 3:
            await self.app.publish(InvoiceOverdue(self.data.invoice_id))
            self.mark_complete()
            return
        self.data.reminders = timeout.reminder
        await self.app.publish(
            ReminderDue(
                self.data.invoice_id, self.data.customer, timeout.reminder
            )
        )
        await self.request_timeout(
            timedelta(days=7), PaymentDue(timeout.reminder + 1)
        )
        # --8<-- [end:saga]

    # --8<-- [start:not_found]
    async def not_found(self, message: object) -> None:
        # paid twice, paid after a cancel, a typo
        if isinstance(message, PaymentReceived):
            raise UnmatchedPayment(
                f"no open invoice for payment {message.reference!r}"
            )
        # anything else: logged at INFO and acknowledged
        await super().not_found(message)
        # --8<-- [end:not_found]


# --8<-- [start:app]
def billing_app() -> App:
    app = App("billing", retry=RetryPolicy(immediate=1, delayed=[0.01]))
    # registers the message types and their handler
    app.register_saga(InvoiceCollection)
    app.subscribe(InvoiceIssued)  # routes and subscriptions as for any handler
    app.subscribe(InvoiceCancelled)
    app.subscribe(PaymentReceived)
    # PaymentDue needs no route: a timeout always comes back to this app's queue
    return app
    # --8<-- [end:app]


# --8<-- [start:test]
async def test_an_unpaid_invoice_is_reminded_three_times_then_overdue() -> None:
    app = billing_app()
    async with Harness(app) as bus:
        await app.publish(InvoiceIssued("i-1", "ada@example.org", 90.0))
        await app.publish(InvoiceIssued("i-2", "alan@example.org", 40.0))
        # the 14-day timeouts wait in the broker
        await bus.idle(include_delayed=False)
        await app.publish(PaymentReceived("INV-i-2", 40.0))
        await bus.idle(include_delayed=False)

        assert await bus.saga_data(InvoiceCollection, "i-1") == Invoice(
            "i-1", "ada@example.org", 90.0
        )
        # paid: complete
        assert await bus.saga_data(InvoiceCollection, "i-2") is None

        # both 14-day timeouts, now; i-2's is ignored
        assert bus.deliver_delayed() == 2
        await bus.idle(include_delayed=False)
        while bus.deliver_delayed():  # each reminder asked for the next one
            await bus.idle(include_delayed=False)

    assert [event.reminder for event in bus.published_of(ReminderDue)] == [
        1,
        2,
        3,
    ]
    assert bus.published_of(InvoiceOverdue) == [InvoiceOverdue("i-1")]
    # overdue: complete
    assert await app.saga_data(InvoiceCollection, "i-1") is None
    # --8<-- [end:test]


async def main() -> tuple[Invoice | None, list[DeadLetter]]:
    """Part-pay an invoice, cancel one, pay a third twice; return what is left.

    Returns the part-paid invoice's data and the dead letters (the second
    payment's).
    """
    app = billing_app()
    async with Harness(app) as bus:
        for invoice_id in ("i-1", "i-2", "i-3"):
            await app.publish(
                InvoiceIssued(invoice_id, "ada@example.org", 50.0)
            )
        await bus.idle(include_delayed=False)
        await app.publish(PaymentReceived("INV-i-1", 20.0))
        await app.publish(InvoiceCancelled("i-2"))
        await app.publish(PaymentReceived("INV-i-3", 50.0))
        await bus.idle(include_delayed=False)
        # again: no open invoice now
        await app.publish(PaymentReceived("INV-i-3", 50.0))
        await app.publish(InvoiceCancelled("i-3"))  # too late: ignored
        await bus.idle(include_delayed=False)
        # the quick retries, not the timeouts
        while bus.deliver_delayed(within=1.0):
            await bus.idle(include_delayed=False)
        left = await bus.saga_data(InvoiceCollection, "i-1")
        return left, bus.dead_lettered


# --8<-- [start:hot]
@message("imports.RowImported.v1")
@dataclass
class RowImported:
    batch_id: str
    row: int


@message("imports.BatchStarted.v1")
@dataclass
class BatchStarted:
    batch_id: str
    rows: int


@message("imports.BatchImported.v1")
@dataclass
class BatchImported:
    batch_id: str
    rows: int


@dataclass
class Batch:
    expected: int = 0  # 0: BatchStarted has not come yet
    imported: int = 0


class BatchProgress(Saga[Batch], name="imports.BatchProgress"):
    started_by = (BatchStarted, RowImported)  # rows may overtake BatchStarted
    correlation = {BatchStarted: "batch_id", RowImported: "batch_id"}

    def __init__(self, app: App) -> None:
        self.app = app

    async def started(self, event: BatchStarted) -> None:
        self.data.expected = event.rows
        await self._finish_if_done(event.batch_id)

    async def row(self, event: RowImported) -> None:
        self.data.imported += 1
        await self._finish_if_done(event.batch_id)

    async def _finish_if_done(self, batch_id: str) -> None:
        if self.data.expected and self.data.imported >= self.data.expected:
            await self.app.publish(BatchImported(batch_id, self.data.imported))
            self.mark_complete()


def imports_app(database: str | None = None) -> App:
    app = App("imports", database=database)
    # many messages at once for one saga
    app.register_saga(BatchProgress, pessimistic=True)
    app.subscribe(BatchStarted)
    app.subscribe(RowImported)
    return app
    # --8<-- [end:hot]


async def import_batch(
    rows: int, database: str | None = None
) -> list[BatchImported]:
    """Publish a batch's rows and its start together; return BatchImported."""
    app = imports_app(database)
    async with Harness(app) as bus:
        for row in range(rows):
            await app.publish(RowImported("b-1", row))
        await app.publish(BatchStarted("b-1", rows))
        await bus.idle()
        assert await bus.saga_data(BatchProgress, "b-1") is None
    return bus.published_of(BatchImported)
