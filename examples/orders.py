"""The orders + billing example: two services on one broker, with failures on purpose.

The "orders" app takes `PlaceOrder` commands. Its handler stores the order through the
message's database session and publishes `OrderPlaced` through the outbox: the row and the event
commit together. Every K-th order's payment is declined: it is retried (immediately, then twice
with a delay) and then dead-lettered to `orders.error`, leaving no row. The "billing" app
subscribes to OrderPlaced and invoices.

    python -m examples.orders --orders 1000 --fail-every 50

It runs on `memory://` and a SQLite file of its own; with `MERSAL_TRANSPORT` and
`MERSAL_DATABASE` set (e.g. RabbitMQ and PostgreSQL, migrated with `mersal db upgrade`) it runs
unchanged on those.

Prints `key=value` figures and a one-line summary; exits 1 unless every order was either
billed or dead-lettered.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from lagom import Container
from sqlalchemy import String, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, Header, MersalError, MessageContext, OutgoingContext, RetryPolicy, message
from mersal.pipeline import Next, Step
from mersal.urls import mask

ERROR_QUEUE = "orders.error"


@message("orders.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    """A customer wants to buy something (a command, sent to the orders app)."""

    order_id: str
    amount: float


@message("orders.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    """An order was accepted and paid (an event, published to whoever subscribes)."""

    order_id: str
    amount: float


class Base(DeclarativeBase):
    """The orders service's own tables."""


class Order(Base):
    """An accepted order, written in the same transaction as its OrderPlaced event."""

    __tablename__ = "example_orders"

    order_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    amount: Mapped[float]


class PaymentDeclined(Exception):
    """The payment provider said no: here, on purpose, for every K-th order."""


@dataclass
class Stats:
    """What happened during the run, counted where it happened."""

    orders: int
    fail_every: int
    handled: int = 0
    stored: int = 0
    published: int = 0
    billed: int = 0
    billed_amount: float = 0.0
    failed_attempts: int = 0
    retried: int = 0
    dead_lettered: int = 0
    dead_letter_attempts: Counter[int] = field(default_factory=Counter)
    dead_letter_errors: Counter[str] = field(default_factory=Counter)
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def declines(self, order_id: str) -> bool:
        """Whether this order's payment fails: every `fail_every`-th order does."""
        number = int(order_id.rpartition("-")[2])
        return self.fail_every > 0 and number % self.fail_every == 0

    async def note_published(self) -> None:
        """An OrderPlaced left the orders app (its transaction committed)."""
        self.published += 1

    def note_billed(self, amount: float) -> None:
        """Billing invoiced an order."""
        self.billed += 1
        self.billed_amount += amount
        self._check_settled()

    def note_dead_letter(self, headers: dict[str, str]) -> None:
        """A message was found in the error queue."""
        self.dead_lettered += 1
        self.dead_letter_attempts[int(headers.get(Header.ERROR_ATTEMPTS, "0"))] += 1
        self.dead_letter_errors[headers.get(Header.ERROR_TYPE, "?").rpartition(".")[2]] += 1
        self._check_settled()

    def _check_settled(self) -> None:
        if self.billed + self.dead_lettered >= self.orders:
            self.settled.set()

    def problems(self) -> list[str]:
        """Why the numbers do not add up (empty when they do)."""
        found = []
        if self.handled + self.dead_lettered != self.orders:
            found.append(
                f"handled ({self.handled}) + dead_lettered ({self.dead_lettered}) "
                f"!= orders ({self.orders})"
            )
        if self.stored != self.handled:
            found.append(f"stored ({self.stored}) != handled ({self.handled})")
        if self.billed != self.published:
            found.append(f"billed ({self.billed}) != published ({self.published})")
        if self.failed_attempts != self.retried + self.dead_lettered:
            found.append(
                f"failed_attempts ({self.failed_attempts}) != retried ({self.retried}) "
                f"+ dead_lettered ({self.dead_lettered})"
            )
        return found


class PlaceOrderHandler:
    """Takes an order: declines the payment of every K-th one, accepts the rest."""

    def __init__(
        self, app: App, context: MessageContext, session: AsyncSession, stats: Stats
    ) -> None:
        self.app = app
        self.context = context
        self.session = session
        self.stats = stats

    async def __call__(self, message: PlaceOrder) -> None:
        """Publish OrderPlaced, or raise PaymentDeclined for the orders meant to fail."""
        if self.stats.declines(message.order_id):
            self.stats.failed_attempts += 1
            if self.context.attempt < self.app.retry.max_attempts:
                self.stats.retried += 1
            raise PaymentDeclined(
                f"card declined for {message.order_id} (attempt {self.context.attempt})"
            )
        self.session.add(Order(order_id=message.order_id, amount=message.amount))
        await self.app.publish(OrderPlaced(message.order_id, message.amount))
        self.stats.handled += 1


def count_published(stats: Stats) -> Step[OutgoingContext]:
    """An outgoing step that counts each OrderPlaced once its transaction has committed."""

    async def count(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        await next(context)
        if isinstance(context.message, OrderPlaced):
            if context.transaction is None:
                await stats.note_published()
            else:
                context.transaction.after_commit(stats.note_published)

    return count


def orders_app(transport: str, database: str, stats: Stats) -> App:
    """The orders service: stores each PlaceOrder, publishes OrderPlaced through the outbox."""
    container = Container()
    container[Stats] = stats
    app = App(
        "orders",
        transport=transport,
        database=database,
        retry=RetryPolicy(immediate=1, delayed=[0.05, 0.1], error_queue=ERROR_QUEUE),
        container=container,
    )
    app.register(PlaceOrder, PlaceOrderHandler)
    app.route(PlaceOrder, "orders")
    app.outgoing.insert_after("send", "count-published", count_published(stats))
    return app


def billing_app(transport: str, stats: Stats) -> App:
    """The billing service: invoices every OrderPlaced."""
    app = App("billing", transport=transport)

    async def invoice(message: OrderPlaced) -> None:
        stats.note_billed(message.amount)

    app.register(OrderPlaced, invoice)
    app.subscribe(OrderPlaced)
    return app


async def read_error_queue(app: App, stats: Stats) -> None:
    """Take every message from the error queue, counting it (an operator would inspect it)."""
    consumer = await app.transport.consume(ERROR_QUEUE, prefetch=64)
    try:
        while True:
            delivery = await consumer.get()
            stats.note_dead_letter(delivery.envelope.headers)
            await delivery.ack()
    finally:
        await consumer.close()


def amount_of(number: int) -> float:
    """A made-up but repeatable order amount."""
    return 5.0 + (number * 37 % 200) / 4


async def create_tables(database: str) -> None:
    """Create the example's own table (the outbox and inbox come from `mersal db upgrade`)."""
    engine = create_async_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    finally:
        await engine.dispose()


async def count_orders(database: str) -> int:
    """How many orders the database holds."""
    engine = create_async_engine(database)
    try:
        async with engine.connect() as connection:
            return int(await connection.scalar(select(func.count()).select_from(Order)) or 0)
    finally:
        await engine.dispose()


async def place_orders(
    args: argparse.Namespace, transport: str, database: str
) -> tuple[Stats, float, bool]:
    """Run both apps, place the orders, wait until each is billed or dead-lettered."""
    stats = Stats(orders=args.orders, fail_every=args.fail_every)
    await create_tables(database)
    orders = orders_app(transport, database, stats)
    billing = billing_app(transport, stats)
    # billing starts first, so that its subscription exists before anything is published.
    async with billing, orders:
        reader = asyncio.create_task(read_error_queue(orders, stats))
        started = time.perf_counter()
        for number in range(1, args.orders + 1):
            await orders.send(PlaceOrder(f"order-{number:06d}", amount_of(number)))
        if args.orders == 0:
            stats.settled.set()
        try:
            async with asyncio.timeout(args.timeout):
                await stats.settled.wait()
            finished = True
        except TimeoutError:
            finished = False
        seconds = time.perf_counter() - started
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    stats.stored = await count_orders(database)
    return stats, seconds, finished


def report(stats: Stats, seconds: float, transport: str, quiet: bool) -> None:
    """Print the figures as one `key=value` line, then (unless quiet) a sentence."""
    rate = stats.orders / seconds if seconds > 0 else 0.0
    figures = {
        "orders": stats.orders,
        "handled": stats.handled,
        "stored": stats.stored,
        "published": stats.published,
        "billed": stats.billed,
        "billed_amount": f"{stats.billed_amount:.2f}",
        "failed_attempts": stats.failed_attempts,
        "retried": stats.retried,
        "dead_lettered": stats.dead_lettered,
        "seconds": f"{seconds:.3f}",
        "orders_per_s": f"{rate:.0f}",
    }
    print(" ".join(f"{key}={value}" for key, value in figures.items()))
    if quiet:
        return
    if stats.dead_lettered:
        attempts = sorted(stats.dead_letter_attempts)
        tries = "-".join(str(n) for n in sorted({attempts[0], attempts[-1]}))
        errors = ", ".join(f"{name} x{n}" for name, n in stats.dead_letter_errors.items())
        failed = (
            f"{stats.dead_lettered} dead-lettered to {ERROR_QUEUE!r} after {tries} attempts "
            f"each ({errors}), {stats.retried} retries on the way"
        )
    else:
        failed = "none dead-lettered"
    print(
        f"{stats.orders} orders on {mask(transport)} in {seconds:.2f}s ({rate:.0f}/s): "
        f"{stats.handled} placed, {stats.billed} billed for {stats.billed_amount:.2f}; {failed}."
    )


def configure_logging(verbose: bool) -> None:
    """Errors only, or everything from INFO with --verbose."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # The declines are on purpose; the summary counts every retry and dead letter.
        logging.getLogger("mersal.retry").setLevel(logging.CRITICAL)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m examples.orders", description=__doc__)
    parser.add_argument("--orders", type=int, default=1000, help="orders to place (1000)")
    parser.add_argument(
        "--fail-every", type=int, default=50, metavar="K", help="decline every K-th order (50)"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the orders (60)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the key=value line")
    parser.add_argument("--verbose", action="store_true", help="log retries and app lifecycle")
    args = parser.parse_args(argv)
    if args.orders < 0 or args.fail_every < 0:
        parser.error("--orders and --fail-every must be >= 0 (--fail-every 0: none fails)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; 0 when every order was either billed or dead-lettered."""
    args = parse(argv)
    configure_logging(args.verbose)
    transport = os.environ.get("MERSAL_TRANSPORT") or "memory://example"
    with tempfile.TemporaryDirectory(prefix="mersal-example-") as directory:
        database = os.environ.get("MERSAL_DATABASE") or f"sqlite+aiosqlite:///{directory}/orders.db"
        if not args.quiet:
            every = f"multiples of {args.fail_every}" if args.fail_every else "none"
            print(
                f"placing {args.orders} orders on {mask(transport)} with {mask(database)}; "
                f"declined: {every}",
                flush=True,
            )
        try:
            stats, seconds, finished = asyncio.run(place_orders(args, transport, database))
        except MersalError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    report(stats, seconds, transport, args.quiet)
    problems = stats.problems()
    if not finished:
        problems.insert(0, f"not every order was billed or dead-lettered within {args.timeout:g}s")
    if problems:
        print("the numbers do not add up: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
