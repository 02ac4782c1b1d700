"""The shop's settings: the environment's, else a local broker and database."""

# --8<-- [start:imports]
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# --8<-- [end:imports]

# --8<-- [start:settings]
ORDERS = "shop.orders"
"""The orders service's app: its name is its input queue."""

BILLING = "shop.billing"
"""The billing worker's app, whose queue takes ChargeOrder and RefundPayment."""


@dataclass(frozen=True)
class Settings:
    """Where the broker and the database are, and how long things may take."""

    transport: str = "amqp://guest:guest@127.0.0.1/"
    database: str = "postgresql+asyncpg://postgres@127.0.0.1/shop"
    payment_window: float = 900.0
    """Seconds a customer has to pay before the order is cancelled."""
    start_wait: float = 30.0
    """Seconds the web service waits at start for the broker and database."""

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] = os.environ
    ) -> Settings:
        """What the MERSAL_* and SHOP_* variables say, defaults for the rest."""
        defaults = cls()
        return cls(
            transport=environ.get("MERSAL_TRANSPORT") or defaults.transport,
            database=environ.get("MERSAL_DATABASE") or defaults.database,
            payment_window=float(
                environ.get("SHOP_PAYMENT_WINDOW") or defaults.payment_window
            ),
            start_wait=float(
                environ.get("SHOP_START_WAIT") or defaults.start_wait
            ),
        )
        # --8<-- [end:settings]
