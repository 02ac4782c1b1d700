"""How a delivery ends: steps decide an `Outcome`, and one `Settler` carries it out, once.

Acknowledging, sending a delayed retry, dead-lettering and returning a delivery to its queue all
happen here and nowhere else, after the incoming pipeline has ended, whatever it raised.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mersal.errors import Unroutable, Unsendable
from mersal.messages import Envelope, Header, describe
from mersal.transport import Delivery, Outgoing, Transport, declare_error_queue
from mersal.transport.limits import fit, limits_of

log = logging.getLogger("mersal.settle")

T = TypeVar("T")

MAX_ERROR_TEXT = 4_096
MAX_TRACEBACK = 16_384

REMEMBER_BYTES = 4 * 1024 * 1024
"""The most bytes of errors (message and traceback) a Settler remembers by default."""

ENTRY_OVERHEAD = 256
"""The bytes counted for each remembered outcome besides its texts."""

ERROR_HEADERS = (
    Header.ERROR_TYPE,
    Header.ERROR_MESSAGE,
    Header.ERROR_TRACEBACK,
    Header.ERROR_ATTEMPTS,
    Header.ERROR_QUEUE,
    Header.FAILED_AT,
)
"""The headers dead-lettering adds: why the message failed, where, when."""

KEPT_HEADERS = (
    Header.ERROR_TYPE,
    Header.ERROR_MESSAGE,
    Header.ERROR_ATTEMPTS,
    Header.ERROR_QUEUE,
    Header.FAILED_AT,
    Header.MESSAGE_ID,
    Header.TYPE,
    Header.ATTEMPT,
    Header.DELIVER_AT,
    Header.CONTENT_TYPE,
    Header.CORRELATION_ID,
    Header.PARTITION_KEY,
    Header.REPLAYS,
)
"""Headers a copy keeps (cut if need be) when its headers must shrink to fit the transport."""


class Verdict(enum.Enum):
    """What becomes of a delivery."""

    ACK = "ack"
    """Dealt with (handled, or a duplicate): remove it from its queue."""
    RETRY_LATER = "retry later"
    """Send a copy that comes back after a delay, then remove this one."""
    DEAD_LETTER = "dead letter"
    """Send a copy with the reason to the error queue, then remove this one."""
    GIVE_BACK = "give back"
    """Give it back to its queue as it is (a stop, or the retry or dead letter could not leave)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt failed, read once and safely: an exception's `__str__` may itself raise."""

    type_name: str
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        """The failure `error` describes, whatever its `__str__`, `__repr__` or class does."""
        return cls(error_type(error), error_text(error), error_traceback(error))

    def __str__(self) -> str:
        return f"{self.type_name.rpartition('.')[2]}: {self.message}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a delivery is to be settled, as a step decided it."""

    verdict: Verdict
    attempts: int = 0
    """Attempts made so far (for a retry or a dead letter)."""
    delay: float = 0.0
    """Seconds until the retry (RETRY_LATER), or before giving the delivery back (GIVE_BACK)."""
    failure: Failure | None = None

    @classmethod
    def retry_later(cls, delay: float, attempts: int, failure: Failure) -> Outcome:
        """Send the message back to its queue, to be tried again after `delay` seconds."""
        return cls(Verdict.RETRY_LATER, attempts, delay, failure)

    @classmethod
    def dead_letter(cls, failure: Failure, attempts: int) -> Outcome:
        """Move the message to the error queue with why it failed."""
        return cls(Verdict.DEAD_LETTER, attempts, 0.0, failure)

    @classmethod
    def give_back(cls, pause: float = 0.0) -> Outcome:
        """Give the delivery back to its queue as it is, after `pause` seconds."""
        return cls(Verdict.GIVE_BACK, delay=pause)


ACK = Outcome(Verdict.ACK)
"""The delivery was dealt with."""

GIVE_BACK = Outcome(Verdict.GIVE_BACK)
"""Give the delivery back at once (the worker is stopping)."""


class Settler:
    """Carries out outcomes: the one place where a delivery is acked or returned to its queue.

    A retry or dead letter that cannot be sent returns the delivery to its queue after `backoff`
    seconds (the broker will deliver it again), and the outcome is remembered for that attempt
    (`attempt_key`): when the same delivery comes back, its retry or dead letter is sent again
    without handling it again; a replay or any later attempt of the message is handled. At most
    `remember` outcomes and `remember_bytes` of their errors are kept, the oldest forgotten
    first (a forgotten one is handled again). One that the transport refuses as it is, is cut
    down until it fits: a dead letter always leaves.
    """

    def __init__(
        self,
        transport: Transport,
        error_queue: str,
        *,
        backoff: float = 1.0,
        remember: int = 10_000,
        remember_bytes: int = REMEMBER_BYTES,
    ) -> None:
        self.transport = transport
        self.error_queue = error_queue
        self.backoff = backoff
        self.remember = remember
        self.remember_bytes = remember_bytes
        self._unsent: OrderedDict[AttemptKey, tuple[Outcome, int]] = OrderedDict()
        self._unsent_bytes = 0

    @property
    def remembered_bytes(self) -> int:
        """The size counted for the outcomes remembered now."""
        return self._unsent_bytes

    def unsent(self, delivery: Delivery) -> Outcome | None:
        """The outcome decided before for this attempt, whose retry or dead letter failed."""
        if not self._unsent:
            return None
        key = attempt_key(delivery.envelope)
        kept = self._unsent.pop(key, None) if key is not None else None
        if kept is None:
            return None
        self._unsent_bytes -= kept[1]
        return kept[0]

    async def settle(self, delivery: Delivery, outcome: Outcome) -> Verdict:
        """Settle `delivery` as `outcome` says; what was done. Never raises (but cancellation)."""
        if outcome.verdict is Verdict.GIVE_BACK:
            if outcome.delay > 0:
                await asyncio.sleep(outcome.delay)
            await give_back(delivery)
            return Verdict.GIVE_BACK
        if outcome.verdict is not Verdict.ACK:
            try:
                await self._forward(delivery, outcome)
            except Exception as error:
                what = "retry" if outcome.verdict is Verdict.RETRY_LATER else "dead letter"
                log.error(
                    "the %s of %s failed (%s); giving it back to %r in %gs",
                    what,
                    describe(delivery.envelope.headers),
                    Failure.of(error),
                    delivery.queue,
                    self.backoff,
                )
                self._keep(delivery, outcome)
                await asyncio.sleep(self.backoff)
                await give_back(delivery)
                return Verdict.GIVE_BACK
        await acknowledge(delivery)
        return outcome.verdict

    def _keep(self, delivery: Delivery, outcome: Outcome) -> None:
        key = attempt_key(delivery.envelope)
        if key is None:
            return
        size = remembered_size(key, outcome)
        if size > self.remember_bytes:
            return
        old = self._unsent.pop(key, None)
        if old is not None:
            self._unsent_bytes -= old[1]
        self._unsent[key] = (outcome, size)
        self._unsent_bytes += size
        while len(self._unsent) > self.remember or self._unsent_bytes > self.remember_bytes:
            _, (_, dropped) = self._unsent.popitem(last=False)
            self._unsent_bytes -= dropped

    async def _forward(self, delivery: Delivery, outcome: Outcome) -> None:
        limits = limits_of(self.transport)
        if outcome.verdict is Verdict.RETRY_LATER:
            copy = retry_copy(delivery.envelope, outcome)
            await self.transport.send([Outgoing(delivery.queue, fit(copy, limits, KEPT_HEADERS))])
            return
        copy = fit(dead_letter_copy(delivery, outcome), limits, KEPT_HEADERS)
        try:
            await self.transport.send([Outgoing(self.error_queue, copy)])
        except Unroutable:  # the error queue was deleted since the app declared it
            await declare_error_queue(self.transport, self.error_queue)
            await self.transport.send([Outgoing(self.error_queue, copy)])
        except Unsendable as refused:  # whatever the transport does not take: keep the reason
            log.warning("the dead letter was refused (%s); sending it without its headers", refused)
            bare = {name: copy.headers[name] for name in KEPT_HEADERS if name in copy.headers}
            await self.transport.send([Outgoing(self.error_queue, fit(Envelope(bare, copy.body)))])


AttemptKey = tuple[str, str, str, str]
"""A delivery attempt: message id, `attempt`, `deliver-at` and `replays` headers."""


def attempt_key(envelope: Envelope) -> AttemptKey | None:
    """What tells this attempt of a message from its others; None without a message id.

    A delivery given back comes again with the same headers; a delayed retry carries its
    attempt and deliver-at, and a replay from the error queue its count of replays.
    """
    headers = envelope.headers
    message_id = headers.get(Header.MESSAGE_ID)
    if not message_id:
        return None
    return (
        message_id,
        headers.get(Header.ATTEMPT, ""),
        headers.get(Header.DELIVER_AT, ""),
        headers.get(Header.REPLAYS, ""),
    )


def remembered_size(key: AttemptKey, outcome: Outcome) -> int:
    """The bytes counted for remembering `outcome` under `key`: its texts and an overhead."""
    texts = [*key]
    if outcome.failure is not None:
        texts += [outcome.failure.type_name, outcome.failure.message, outcome.failure.traceback]
    return ENTRY_OVERHEAD + sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)


def retry_copy(envelope: Envelope, outcome: Outcome) -> Envelope:
    """The copy of a message that comes back for its next attempt after the outcome's delay."""
    return envelope.copy(
        **{
            Header.ATTEMPT: str(outcome.attempts),
            Header.DELIVER_AT: f"{time.time() + outcome.delay:.6f}",
        }
    )


def dead_letter_copy(delivery: Delivery, outcome: Outcome) -> Envelope:
    """The copy of a message for the error queue: its body and headers, and why it failed."""
    failure = outcome.failure or Failure("mersal.errors.MersalError", "no reason was given")
    envelope = delivery.envelope.copy(**error_headers(failure, outcome.attempts, delivery.queue))
    # A deliver-at that came with the message (forged, or left from a delay) must not hold the
    # dead letter back: transports honour it at send time (RabbitMQ: a wait queue).
    envelope.headers.pop(Header.DELIVER_AT, None)
    return envelope


def error_headers(failure: Failure, attempts: int, queue: str) -> dict[str, str]:
    """The headers that tell an operator why a message is in the error queue."""
    return {
        Header.ERROR_TYPE: failure.type_name,
        Header.ERROR_MESSAGE: failure.message,
        Header.ERROR_TRACEBACK: failure.traceback,
        Header.ERROR_ATTEMPTS: str(attempts),
        Header.ERROR_QUEUE: queue,
        Header.FAILED_AT: f"{time.time():.6f}",
    }


async def acknowledge(delivery: Delivery) -> None:
    """Ack a delivery; a failed ack is logged, since the broker will deliver it again."""
    try:
        await delivery.ack()
    except Exception as error:
        log.warning(
            "could not ack %s from %s (%s); the broker will deliver it again",
            describe(delivery.envelope.headers),
            delivery.queue,
            Failure.of(error),
        )


async def give_back(delivery: Delivery) -> None:
    """Give a delivery back to its queue; if that fails, the broker gives it back by itself."""
    try:
        await delivery.nack(requeue=True)
    except Exception as error:
        log.warning(
            "could not give %s back to %s (%s); the broker will deliver it again",
            describe(delivery.envelope.headers),
            delivery.queue,
            Failure.of(error),
        )


async def run_to_end(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile; then re-raise that."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.done():
                raise
            cancelled = error
            continue
        except BaseException:
            if cancelled is not None:
                raise cancelled from None
            raise
        if cancelled is not None:
            raise cancelled
        return result


_stopped: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
"""The tasks a worker cancelled because it is stopping."""


def cancel_for_stop(task: asyncio.Task[Any]) -> None:
    """Cancel a task because its worker is stopping: not a failed attempt."""
    _stopped.add(task)
    task.cancel()


def cancelled_by_owner() -> bool:
    """Whether the running task is being cancelled by its worker's stop (not by its handler)."""
    task = asyncio.current_task()
    return task is not None and task in _stopped and task.cancelling() > 0


def absorb_cancellation() -> None:
    """Forget a cancellation handled as a failed attempt (a handler cancelled its own task)."""
    task = asyncio.current_task()
    if task is not None and task not in _stopped and task.cancelling() > 0:
        task.uncancel()


def error_type(error: BaseException) -> str:
    """`module.QualName` of the exception's class, whatever the class claims."""
    cls = type(error)
    module = _safe(lambda: str(cls.__module__), "?")
    name = _safe(lambda: str(cls.__qualname__), _safe(lambda: str(cls.__name__), "?"))
    return f"{module}.{name}"


def error_text(error: BaseException) -> str:
    """`str(error)`, or `repr`, or a placeholder, cut to MAX_ERROR_TEXT characters."""
    text = _safe(lambda: str(error), None)
    if text is None:
        text = _safe(lambda: repr(error), None)
    if text is None:
        text = f"<{error_type(error)} whose str() and repr() fail>"
    return text[:MAX_ERROR_TEXT]


def error_traceback(error: BaseException) -> str:
    """The formatted traceback of `error`, its last MAX_TRACEBACK characters."""
    trace = _safe(lambda: "".join(traceback.format_exception(error)), "")
    return trace[-MAX_TRACEBACK:]


def _safe(render: Callable[[], str], fallback: T) -> str | T:
    try:
        text = render()
    except BaseException:
        return fallback
    return text if isinstance(text, str) else fallback
