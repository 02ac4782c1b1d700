"""The billing worker: `mersal run examples.shop.billing:create_app`."""

# --8<-- [start:imports]
from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from examples.shop.db import Payment
from examples.shop.messages import ChargeOrder, PaymentReceived, RefundPayment
from examples.shop.settings import BILLING, Settings
from mersal import App

# --8<-- [end:imports]


# --8<-- [start:handlers]
class Charge:
    """Charges an order and says so: payment row and event commit together."""

    def __init__(self, app: App, session: AsyncSession) -> None:
        self.app = app
        # the message's session: Mersal commits it with the inbox row
        self.session = session

    async def __call__(self, command: ChargeOrder) -> None:
        # a real service would call its payment provider here, with the order id
        # as idempotency key
        payment = Payment(
            order_id=command.order_id, amount=command.amount, status="charged"
        )
        self.session.add(payment)
        await self.app.publish(
            PaymentReceived(command.order_id, command.amount)
        )


class Refund:
    """Gives back the payment of an order cancelled before it was paid."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, command: RefundPayment) -> None:
        payment = await self.session.get(Payment, command.order_id)
        if payment is not None:
            payment.status = "refunded"
            # --8<-- [end:handlers]


# --8<-- [start:app]
def create_app(settings: Settings | None = None) -> App:
    """The billing app (the environment's settings unless given others)."""
    settings = settings or Settings.from_environment()
    app = App(BILLING, transport=settings.transport, database=settings.database)
    app.register(ChargeOrder, Charge)
    app.register(RefundPayment, Refund)
    # the orders service sends them here: say so
    app.route(ChargeOrder, BILLING)
    app.route(RefundPayment, BILLING)
    return app
    # --8<-- [end:app]
