"""The polling worker: pulls deliveries, runs them concurrently, one lane per partition key."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from mersal.messages import describe
from mersal.transport import Consumer, Delivery

log = logging.getLogger("mersal.worker")

Handle = Callable[[Delivery], Awaitable[None]]


class Worker:
    """Runs up to `concurrency` deliveries at once; those sharing a partition key run in order."""

    def __init__(
        self, consumer: Consumer, handle: Handle, concurrency: int, backoff: float = 1.0
    ) -> None:
        self.consumer = consumer
        self.concurrency = concurrency
        self.backoff = backoff
        self._handle = handle
        self._room = asyncio.Semaphore(concurrency)
        self._lanes: dict[str, deque[Delivery]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._fetcher: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def in_flight(self) -> int:
        """How many deliveries are being handled or wait in a lane."""
        return len(self._tasks) + sum(len(lane) for lane in self._lanes.values())

    def start(self) -> None:
        """Begin pulling deliveries."""
        self._fetcher = asyncio.create_task(self._fetch(), name="mersal-worker")
        self._fetcher.add_done_callback(self._fetch_ended)

    async def stop(self, grace: float) -> None:
        """Stop pulling, let in-flight work finish within `grace` seconds, return the rest."""
        self._stopping = True
        if self._fetcher is not None:
            self._fetcher.cancel()
            await asyncio.gather(self._fetcher, return_exceptions=True)
        await self.consumer.close()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "%d message(s) did not finish within %gs; returned", len(pending), grace
                )
                await asyncio.gather(*pending, return_exceptions=True)

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
                "the worker stopped receiving (%s: %s); the app takes no more messages until "
                "it is restarted",
                type(self.failed).__name__,
                self.failed,
            )

    async def _fetch(self) -> None:
        room, lanes = self._room, self._lanes
        while True:
            await room.acquire()
            try:
                delivery = await self.consumer.get()
            except BaseException:
                room.release()
                raise
            key = delivery.envelope.partition_key
            if key is None:
                self._spawn(self._run(delivery))
            elif key in lanes:
                lanes[key].append(delivery)
                room.release()  # it waits behind its key without taking a slot
            else:
                lanes[key] = deque()
                self._spawn(self._run_lane(key, delivery))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, delivery: Delivery) -> None:
        try:
            await self._settle(delivery)
        finally:
            self._room.release()

    async def _run_lane(self, key: str, delivery: Delivery) -> None:
        lane = self._lanes[key]
        try:
            await self._run(delivery)
            while lane and not self._stopping:
                await self._room.acquire()
                await self._run(lane.popleft())
        finally:
            del self._lanes[key]
            while lane:
                await self._return(lane.popleft())

    async def _settle(self, delivery: Delivery) -> None:
        try:
            await self._handle(delivery)
        except asyncio.CancelledError:
            await asyncio.shield(self._return(delivery))
            raise
        except Exception:
            log.exception(
                "unexpected failure around %s; returning it in %gs",
                describe(delivery.envelope.headers),
                self.backoff,
            )
            await asyncio.sleep(self.backoff)
            await self._return(delivery)

    async def _return(self, delivery: Delivery) -> None:
        try:
            await delivery.nack(requeue=True)
        except Exception as error:
            log.warning(
                "could not return %s to %s (%s: %s); the broker will deliver it again",
                delivery.envelope.message_id,
                delivery.queue,
                type(error).__name__,
                error,
            )
