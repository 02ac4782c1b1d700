"""The polling worker: pulls deliveries, runs them concurrently, one lane per partition key.

Each delivery goes to `receive` (a `mersal.receiving.Receiver`), which says how to settle it (an
`Outcome`), and is then settled by the `Settler`, exactly once, even when the worker is stopped
meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from mersal.settle import (
    GIVE_BACK,
    Failure,
    Outcome,
    Settler,
    Verdict,
    cancel_for_stop,
    run_to_end,
)
from mersal.transport import Consumer, Delivery

log = logging.getLogger("mersal.worker")

Receive = Callable[[Delivery], Awaitable[Outcome]]
"""How a delivery is to be settled, once handled; raises only when the worker's stop cancels it."""

MIN_CANCEL_WAIT = 5.0
"""Seconds a stop waits for cancelled handlers to end before it leaves them."""


class Worker:
    """Handles up to `concurrency` deliveries at once; those sharing a partition key, in order.

    A delivery waiting behind another of its key takes no place among the `concurrency`: it only
    counts against the consumer's prefetch, so that other keys go on being fetched and handled
    while one key is busy.
    """

    def __init__(
        self,
        consumer: Consumer,
        receive: Receive,
        settler: Settler,
        *,
        concurrency: int,
    ) -> None:
        self.consumer = consumer
        self.settler = settler
        self.concurrency = concurrency
        self._receive = receive
        self._slots = asyncio.Semaphore(concurrency)
        self._lanes: dict[str, deque[Delivery]] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        self._settling: set[asyncio.Task[Any] | None] = set()
        self._fetcher: asyncio.Task[None] | None = None
        self._stopping = False
        self._started: dict[int, tuple[Delivery, float]] = {}
        """The deliveries being handled or settled, each with the loop time it began, by id
        (a transport's deliveries need not be hashable)."""

    @property
    def in_flight(self) -> int:
        """How many deliveries are being handled or wait in a lane."""
        return len(self._tasks) + sum(len(lane) for lane in self._lanes.values())

    def handling(self) -> list[tuple[Delivery, float]]:
        """The deliveries being handled (or settled) now, each with the seconds it has taken."""
        now = asyncio.get_running_loop().time()
        return [(delivery, now - began) for delivery, began in self._started.values()]

    def start(self) -> None:
        """Begin pulling deliveries."""
        self._fetcher = asyncio.create_task(self._fetch(), name="mersal-worker")
        self._fetcher.add_done_callback(self._fetch_ended)

    async def stop(self, grace: float) -> int:
        """Stop pulling, let in-flight work finish within `grace` seconds, return the rest.

        Returns how many deliveries did not finish within `grace` (given back to the broker).
        """
        if self._fetcher is not None:
            self._fetcher.cancel()
            await asyncio.gather(self._fetcher, return_exceptions=True)
        # Closed first: a lane that gives its waiting deliveries back does so to a closed
        # consumer, which returns them to their place (a nack would send them to a quorum
        # queue's tail, behind later messages of their key).
        await self.consumer.close()
        self._stopping = True
        if not self._tasks:
            return 0
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        unfinished = len(pending)
        deadline = asyncio.get_running_loop().time() + max(grace, MIN_CANCEL_WAIT)
        while pending:  # cancel handling, not settling: a settle runs to its end
            for task in pending - self._settling:
                cancel_for_stop(task)
            _, pending = await asyncio.wait(pending, timeout=0.05)
            if pending and asyncio.get_running_loop().time() > deadline:
                log.error(
                    "%d handler(s) ignore cancellation; leaving them: the transport returns "
                    "their messages when it stops",
                    len(pending),
                )
                return unfinished
        return unfinished

    @property
    def failed(self) -> BaseException | None:
        """Why the worker stopped receiving on its own, if it did."""
        fetcher = self._fetcher
        if fetcher is None or not fetcher.done() or fetcher.cancelled():
            return None
        return fetcher.exception()

    def _fetch_ended(self, fetcher: asyncio.Task[None]) -> None:
        if not self._stopping and self.failed is not None:
            log.error(
                "the worker stopped receiving (%s); the app takes no more messages until it is "
                "restarted",
                Failure.of(self.failed),
            )

    async def _fetch(self) -> None:
        slots, lanes = self._slots, self._lanes
        while True:
            await slots.acquire()
            try:
                delivery = await self.consumer.get()
            except BaseException:
                slots.release()
                raise
            key = delivery.envelope.partition_key
            if key is None:
                self._spawn(self._settle(delivery))
            elif key in lanes:
                lanes[key].append(delivery)
                slots.release()  # it waits behind its key without taking a slot
            else:
                lanes[key] = deque()
                self._spawn(self._run_lane(key, delivery))

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_lane(self, key: str, delivery: Delivery) -> None:
        lane = self._lanes[key]
        try:
            done = await self._settle(delivery)
            while lane and not self._stopping and done is not Verdict.GIVE_BACK:
                await self._slots.acquire()
                done = await self._settle(lane.popleft())
        finally:
            # A key whose message went back to the queue gives back the ones behind it too,
            # so that none of them overtakes it.
            del self._lanes[key]
            if lane:
                await run_to_end(self._give_back_all(lane))

    async def _give_back_all(self, lane: deque[Delivery]) -> None:
        while lane:
            await self.settler.settle(lane.popleft(), GIVE_BACK)

    async def _settle(self, delivery: Delivery) -> Verdict:
        """Handle one delivery (in a slot taken for it), settle it, say how; frees the slot.

        A stop cancels a task while it handles, never while it settles (see `stop`).
        """
        self._started[id(delivery)] = (delivery, asyncio.get_running_loop().time())
        try:
            try:
                outcome = await self._receive(delivery)
            except asyncio.CancelledError:
                await run_to_end(self.settler.settle(delivery, GIVE_BACK))
                raise
            if outcome.verdict is Verdict.ACK:  # an ack does not wait on the broker
                return await self.settler.settle(delivery, outcome)
            task = asyncio.current_task()
            self._settling.add(task)
            try:
                return await self.settler.settle(delivery, outcome)
            finally:
                self._settling.discard(task)
        finally:
            self._started.pop(id(delivery), None)
            self._slots.release()
