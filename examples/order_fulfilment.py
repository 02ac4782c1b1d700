"""Order fulfilment with a saga: ship an order once it is paid and its stock is reserved.

The "shop" app runs the `OrderFulfilment` saga, one instance per order. `OrderPlaced` starts
it: it asks the warehouse to reserve the stock and sets a payment deadline (a timeout).
`PaymentReceived` and `StockReserved` then come in either order; when both have, the saga
sends `ShipOrder` and completes, and the warehouse ships and publishes `OrderShipped`. An
order not paid by the deadline is cancelled: the saga publishes `OrderCancelled` and sends
`ReleaseStock`. A payment that finds no open order (paid twice, or after the cancel) fails,
and ends in the error queue after its retries, for someone to refund.

The "warehouse" app keeps its stock in memory. Books are in stock; lamps are not until the
run restocks them, so lamp orders wait for their stock after they are paid.

    python -m examples.order_fulfilment --orders 12 --unpaid-every 4 --payment-window 1

It runs on `memory://` and SQLite files of its own; with `MERSAL_TRANSPORT` and
`MERSAL_DATABASE` set (e.g. RabbitMQ and PostgreSQL, migrated with `mersal db upgrade`) it runs
unchanged on those.

Prints `key=value` figures and a one-line summary; exits 1 unless every paid order was shipped
and every unpaid one cancelled, with its stock released and no saga left running.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from lagom import Container

from mersal import App, MersalError, RetryPolicy, message
from mersal.sagas import Saga
from mersal.urls import mask

SHOP = "shop"
WAREHOUSE = "warehouse"
RETRY = RetryPolicy(immediate=1, delayed=[0.2, 1.0, 5.0])


# -- messages --------------------------------------------------------------------------------


@message("shop.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    """A customer placed an order (an event of the shop's storefront)."""

    order_id: str
    sku: str
    quantity: int


@message("payments.PaymentReceived.v1")
@dataclass
class PaymentReceived:
    """The payment provider took the customer's money for an order."""

    order_id: str


@message("warehouse.ReserveStock.v1")
@dataclass
class ReserveStock:
    """Put stock aside for an order, now or when it comes in (a command to the warehouse)."""

    order_id: str
    sku: str
    quantity: int


@message("warehouse.StockReserved.v1")
@dataclass
class StockReserved:
    """The warehouse put an order's stock aside; it names the order its own way."""

    order_ref: str


@message("warehouse.Restock.v1")
@dataclass
class Restock:
    """New stock arrived (a command to the warehouse)."""

    sku: str
    quantity: int


@message("warehouse.ShipOrder.v1")
@dataclass
class ShipOrder:
    """Ship an order's reserved stock (a command to the warehouse)."""

    order_id: str


@message("warehouse.ReleaseStock.v1")
@dataclass
class ReleaseStock:
    """Give an order's stock back, reserved or still awaited (a command to the warehouse)."""

    order_id: str


@message("warehouse.OrderShipped.v1")
@dataclass
class OrderShipped:
    """An order left the warehouse."""

    order_id: str


@message("shop.OrderCancelled.v1")
@dataclass
class OrderCancelled:
    """The shop gave up on an order."""

    order_id: str
    reason: str


@message("shop.PaymentOverdue.v1")
@dataclass
class PaymentOverdue:
    """The saga's timeout: the payment deadline of an order has passed."""

    order_id: str


# -- the shop: the saga ----------------------------------------------------------------------


@dataclass
class Settings:
    """The shop's settings, injected into the saga."""

    payment_window: float = 1800.0
    """Seconds a customer has to pay after placing an order."""


@dataclass
class Fulfilment:
    """One order's progress: the saga's data, stored between its messages."""

    order_id: str = ""
    paid: bool = False
    reserved: bool = False


class UnmatchedPayment(Exception):
    """A payment for an order that is not waiting for one: it needs a refund."""


class OrderFulfilment(Saga[Fulfilment], name="shop.OrderFulfilment"):
    """Ships an order once it is paid and its stock reserved; cancels it if it is not paid."""

    started_by = (OrderPlaced,)
    correlation = {
        OrderPlaced: "order_id",
        PaymentReceived: "order_id",
        StockReserved: lambda event: event.order_ref,
    }

    def __init__(self, app: App, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def placed(self, event: OrderPlaced) -> None:
        """Reserve the stock and start the payment deadline."""
        self.data.order_id = event.order_id
        await self.app.send(ReserveStock(event.order_id, event.sku, event.quantity))
        await self.request_timeout(self.settings.payment_window, PaymentOverdue(event.order_id))

    async def paid(self, event: PaymentReceived) -> None:
        """Note the payment; ship if the stock is reserved too."""
        self.data.paid = True
        await self._ship_if_ready()

    async def reserved(self, event: StockReserved) -> None:
        """Note the reservation; ship if the order is paid too."""
        self.data.reserved = True
        await self._ship_if_ready()

    async def overdue(self, timeout: PaymentOverdue) -> None:
        """Cancel the order unless it was paid (a paid order waits for its stock)."""
        if self.data.paid:
            return
        await self.app.send(ReleaseStock(self.data.order_id))
        await self.app.publish(OrderCancelled(self.data.order_id, "not paid in time"))
        self.mark_complete()

    async def not_found(self, message: object) -> None:
        """A payment without an open order fails; anything else is logged and dropped."""
        if isinstance(message, PaymentReceived):
            raise UnmatchedPayment(
                f"payment for order {message.order_id!r}, which is not waiting for one: refund it"
            )
        await super().not_found(message)

    async def _ship_if_ready(self) -> None:
        if self.data.paid and self.data.reserved:
            await self.app.send(ShipOrder(self.data.order_id))
            self.mark_complete()


@dataclass
class Outcomes:
    """What customers were told, recorded by the shop's notification handlers."""

    shipped: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)


def route_warehouse_commands(app: App) -> None:
    """Send the warehouse's commands to its queue."""
    for command in (ReserveStock, Restock, ShipOrder, ReleaseStock):
        app.route(command, WAREHOUSE)


def shop_app(
    transport: str | None = None,
    database: str | None = None,
    settings: Settings | None = None,
    outcomes: Outcomes | None = None,
) -> App:
    """The shop: the fulfilment saga, and handlers that tell customers how their order went."""
    container = Container()
    container[Settings] = settings or Settings()
    told = outcomes if outcomes is not None else Outcomes()
    app = App(SHOP, transport=transport, database=database, retry=RETRY, container=container)
    app.register_saga(OrderFulfilment)
    for event in (OrderPlaced, PaymentReceived, StockReserved):
        app.subscribe(event)

    async def shipped(event: OrderShipped) -> None:
        told.shipped.add(event.order_id)  # stands for an email to the customer

    async def cancelled(event: OrderCancelled) -> None:
        told.cancelled.add(event.order_id)

    app.register(OrderShipped, shipped)
    app.subscribe(OrderShipped)
    app.register(OrderCancelled, cancelled)
    app.subscribe(OrderCancelled)
    route_warehouse_commands(app)
    return app


# -- the warehouse ---------------------------------------------------------------------------


@dataclass
class Stock:
    """The warehouse's stock, in this process's memory (a real one keeps it in its database)."""

    on_hand: dict[str, int]
    reserved: dict[str, ReserveStock] = field(default_factory=dict)
    awaited: list[ReserveStock] = field(default_factory=list)
    shipped: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def reserve(self, request: ReserveStock) -> bool:
        """Put the stock aside if there is enough, else await it; whether it was put aside."""
        if request.order_id in self.reserved:
            return True
        if any(waiting.order_id == request.order_id for waiting in self.awaited):
            return False
        if self.on_hand.get(request.sku, 0) >= request.quantity:
            self.on_hand[request.sku] -= request.quantity
            self.reserved[request.order_id] = request
            return True
        self.awaited.append(request)
        return False

    def restock(self, sku: str, quantity: int) -> list[ReserveStock]:
        """Add stock, and put it aside for the orders awaiting it, oldest first."""
        self.on_hand[sku] = self.on_hand.get(sku, 0) + quantity
        waiting, self.awaited = self.awaited, []
        return [request for request in waiting if self.reserve(request)]

    def ship(self, order_id: str) -> None:
        """The reserved stock leaves."""
        self.reserved.pop(order_id, None)
        self.shipped.append(order_id)

    def release(self, order_id: str) -> None:
        """Give back the order's reserved stock, or stop awaiting it."""
        request = self.reserved.pop(order_id, None)
        if request is not None:
            self.on_hand[request.sku] += request.quantity
        self.awaited = [waiting for waiting in self.awaited if waiting.order_id != order_id]
        self.released.append(order_id)


def warehouse_app(stock: Stock, transport: str | None = None, database: str | None = None) -> App:
    """The warehouse: reserves, ships and releases stock."""
    app = App(WAREHOUSE, transport=transport, database=database, retry=RETRY)

    async def reserve(command: ReserveStock) -> None:
        if stock.reserve(command):
            await app.publish(StockReserved(order_ref=command.order_id))

    async def restock(command: Restock) -> None:
        for request in stock.restock(command.sku, command.quantity):
            await app.publish(StockReserved(order_ref=request.order_id))

    async def ship(command: ShipOrder) -> None:
        stock.ship(command.order_id)
        await app.publish(OrderShipped(command.order_id))

    async def release(command: ReleaseStock) -> None:
        stock.release(command.order_id)

    app.register(ReserveStock, reserve)
    app.register(Restock, restock)
    app.register(ShipOrder, ship)
    app.register(ReleaseStock, release)
    route_warehouse_commands(app)
    return app


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Plan:
    """Which orders the run places, pays and puts on backorder."""

    orders: int = 12
    unpaid_every: int = 4
    backorder_every: int = 3
    payment_window: float = 1.0
    timeout: float = 60.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def order_ids(self) -> list[str]:
        """The run's order ids (unique per run, so a reused database does not mix runs)."""
        return [f"{self.run_id}-{number:04d}" for number in range(1, self.orders + 1)]

    def pays(self, number: int) -> bool:
        """Whether the customer of the `number`-th order pays (1-based)."""
        return not (self.unpaid_every and number % self.unpaid_every == 0)

    def sku(self, number: int) -> str:
        """A lamp (out of stock until restocked) for every `backorder_every`-th order."""
        return "lamp" if self.backorder_every and number % self.backorder_every == 0 else "book"


@dataclass
class Report:
    """What the run saw."""

    paid: set[str]
    unpaid: set[str]
    backordered: int
    shipped_after_restock: int
    shipped: set[str]
    cancelled: set[str]
    released: set[str]
    sagas_left: int
    stock: dict[str, int]
    expected_stock: dict[str, int]
    seconds: float
    finished: bool

    def problems(self) -> list[str]:
        """Why the numbers do not add up (empty when they do)."""
        found = []
        if not self.finished:
            found.append("not every order was shipped or cancelled in time")
        if self.shipped != self.paid:
            found.append(f"shipped {len(self.shipped)} orders, but {len(self.paid)} were paid")
        if self.cancelled != self.unpaid:
            found.append(f"cancelled {len(self.cancelled)}, but {len(self.unpaid)} went unpaid")
        if self.released != self.cancelled:
            found.append(f"released the stock of {len(self.released)} orders, not of each cancel")
        if self.sagas_left:
            found.append(f"{self.sagas_left} sagas still running")
        if self.stock != self.expected_stock:
            found.append(f"stock on hand {self.stock}, expected {self.expected_stock}")
        return found


async def fulfil(
    plan: Plan, transport: str, database: str | None, warehouse_database: str | None = None
) -> Report:
    """Run the shop and the warehouse, place, pay and restock; wait for every order to end.

    The warehouse uses `warehouse_database`, or the shop's `database` if it is None.
    """
    books = plan.orders
    stock = Stock(on_hand={"book": books, "lamp": 0})
    outcomes = Outcomes()
    settings = Settings(payment_window=plan.payment_window)
    warehouse = warehouse_app(stock, transport, warehouse_database or database)
    shop = shop_app(transport, database, settings, outcomes)
    ids = plan.order_ids()
    numbered = list(enumerate(ids, start=1))
    paid = {order_id for number, order_id in numbered if plan.pays(number)}
    lamps = [order_id for number, order_id in numbered if plan.sku(number) == "lamp"]
    # the warehouse first: the shop sends to its queue; the shop before anything is published
    async with warehouse, shop:
        started = time.perf_counter()
        for number, order_id in numbered:
            await shop.publish(OrderPlaced(order_id, plan.sku(number), 1))
        deadline = started + plan.timeout
        # wait for the sagas to start, so that no payment comes before its order
        for order_id in ids:
            while await shop.saga_data(OrderFulfilment, order_id) is None:
                if time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.01)
        for order_id in ids:
            if order_id in paid:
                await shop.publish(PaymentReceived(order_id))
        if lamps:
            await shop.send(Restock("lamp", len(lamps)))
        finished = False
        while time.perf_counter() < deadline:
            ended = outcomes.shipped | outcomes.cancelled
            if len(ended) == plan.orders and set(stock.released) >= outcomes.cancelled:
                finished = True
                break
            await asyncio.sleep(0.02)
        seconds = time.perf_counter() - started
        running = 0
        for order_id in ids:
            if await shop.saga_data(OrderFulfilment, order_id) is not None:
                running += 1
    shipped_lamps = len(outcomes.shipped & set(lamps))
    return Report(
        paid=paid,
        unpaid=set(ids) - paid,
        backordered=len(lamps),
        shipped_after_restock=shipped_lamps,
        shipped=set(outcomes.shipped),
        cancelled=set(outcomes.cancelled),
        released=set(stock.released),
        sagas_left=running,
        stock=dict(stock.on_hand),
        expected_stock={
            "book": books - (len(outcomes.shipped) - shipped_lamps),
            "lamp": len(lamps) - shipped_lamps,
        },
        seconds=seconds,
        finished=finished,
    )


def report(result: Report, plan: Plan, transport: str, quiet: bool) -> None:
    """Print the figures as one `key=value` line, then (unless quiet) a sentence."""
    figures = {
        "orders": plan.orders,
        "paid": len(result.paid),
        "unpaid": len(result.unpaid),
        "backordered": result.backordered,
        "shipped": len(result.shipped),
        "cancelled": len(result.cancelled),
        "released": len(result.released),
        "sagas_left": result.sagas_left,
        "seconds": f"{result.seconds:.3f}",
    }
    print(" ".join(f"{key}={value}" for key, value in figures.items()))
    if quiet:
        return
    print(
        f"{plan.orders} orders on {mask(transport)} in {result.seconds:.2f}s: "
        f"{len(result.shipped)} paid and shipped ({result.shipped_after_restock} after a restock), "
        f"{len(result.cancelled)} cancelled after the {plan.payment_window:g}s payment window "
        f"with their stock released; {result.sagas_left} sagas left running."
    )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.order_fulfilment", description=__doc__
    )
    parser.add_argument("--orders", type=int, default=12, help="orders to place (12)")
    parser.add_argument(
        "--unpaid-every", type=int, default=4, metavar="K", help="leave every K-th unpaid (4)"
    )
    parser.add_argument(
        "--backorder-every",
        type=int,
        default=3,
        metavar="M",
        help="every M-th order is for a lamp, out of stock until restocked (3)",
    )
    parser.add_argument(
        "--payment-window", type=float, default=1.0, help="seconds to pay an order (1)"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the orders (60)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the key=value line")
    parser.add_argument("--verbose", action="store_true", help="log at INFO")
    args = parser.parse_args(argv)
    if min(args.orders, args.unpaid_every, args.backorder_every) < 0:
        parser.error("--orders, --unpaid-every and --backorder-every must be >= 0")
    if args.payment_window < 0:
        parser.error("--payment-window must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; 0 when every order ended as it should."""
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )
    plan = Plan(
        orders=args.orders,
        unpaid_every=args.unpaid_every,
        backorder_every=args.backorder_every,
        payment_window=args.payment_window,
        timeout=args.timeout,
    )
    transport = os.environ.get("MERSAL_TRANSPORT") or "memory://example"
    with tempfile.TemporaryDirectory(prefix="mersal-example-") as directory:
        database = os.environ.get("MERSAL_DATABASE") or f"sqlite+aiosqlite:///{directory}/shop.db"
        # SQLite writes one transaction at a time: a file for each app, so they do not queue
        warehouse_database = os.environ.get("MERSAL_DATABASE") or database.replace(
            "shop.db", "warehouse.db"
        )
        if not args.quiet:
            print(
                f"placing {plan.orders} orders on {mask(transport)} with {mask(database)}",
                flush=True,
            )
        try:
            result = asyncio.run(fulfil(plan, transport, database, warehouse_database))
        except MersalError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    report(result, plan, transport, args.quiet)
    problems = result.problems()
    if problems:
        print("the numbers do not add up: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
