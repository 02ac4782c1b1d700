"""Retries and dead letters: immediate, then delayed, then the error queue."""

from __future__ import annotations

from dataclasses import dataclass

from mersal import App, RetryPolicy, message
from mersal.testing import DeadLetter, Harness


@message("payments.Charge.v1")
@dataclass
class Charge:
    order_id: str
    amount: float


# --8<-- [start:policy]
class PaymentDeclined(Exception):
    """The provider said no, this time: worth trying again."""


class InvalidAmount(Exception):
    """No retry can fix this one."""


def build_app() -> App:
    retry = RetryPolicy(
        immediate=1,  # one more attempt at once, in the process
        # then one attempt after each delay, through the broker
        delayed=[0.05, 0.1],
        # then here, with the reason in its headers
        error_queue="payments.error",
        fail_fast=(InvalidAmount,),  # straight to the error queue, no retries
    )
    app = App("payments", retry=retry)

    async def charge(message: Charge) -> None:
        if message.amount <= 0:
            raise InvalidAmount(f"cannot charge {message.amount}")
        raise PaymentDeclined(f"card declined for {message.order_id}")

    app.register(Charge, charge)
    app.route(Charge, "payments")
    return app
    # --8<-- [end:policy]


async def main() -> list[DeadLetter]:
    """Charge two orders that both fail; return their dead letters."""
    app = build_app()
    async with Harness(app) as bus:
        await app.send(Charge("o-1", 9.5))
        await app.send(Charge("o-2", 0))
        await bus.idle()
    return bus.dead_lettered
