"""Retries: immediate ones in process, delayed ones through the broker, then the error queue."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mersal.errors import ConfigurationError, DecodeError
from mersal.messages import Envelope, Header, describe
from mersal.pipeline import MessageContext, Next, acknowledge, now
from mersal.transport import Outgoing

log = logging.getLogger("mersal.retry")

MAX_ERROR_TEXT = 4_096
MAX_TRACEBACK = 16_384
MAX_ATTEMPTS = 1_000
MAX_HEADER_BYTES = 65_536
CUT_TO = 1_024


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failing message is tried again before it goes to the error queue.

    `immediate` in-process retries follow the first attempt; then one delayed attempt per entry
    of `delayed` (seconds), each through the broker; then the error queue. Exceptions in
    `fail_fast` skip the retries.
    """

    immediate: int = 2
    delayed: Sequence[float] = (1.0, 10.0, 60.0)
    error_queue: str = "error"
    fail_fast: tuple[type[BaseException], ...] = field(default=())

    def __post_init__(self) -> None:
        if (
            isinstance(self.immediate, bool)
            or not isinstance(self.immediate, int)
            or self.immediate < 0
        ):
            raise ConfigurationError(
                f"RetryPolicy(immediate={self.immediate!r}) must be an int >= 0"
            )
        delays = _as_tuple(self.delayed, "delayed", "seconds")
        if any(
            isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < math.inf
            for d in delays
        ):
            raise ConfigurationError(
                f"RetryPolicy(delayed={list(self.delayed)!r}) must list seconds >= 0"
            )
        object.__setattr__(self, "delayed", delays)
        if not self.error_queue or not isinstance(self.error_queue, str):
            raise ConfigurationError("RetryPolicy(error_queue=...) must name a queue")
        fail_fast = _as_tuple(self.fail_fast, "fail_fast", "exception classes")
        if any(not (isinstance(t, type) and issubclass(t, BaseException)) for t in fail_fast):
            raise ConfigurationError("RetryPolicy(fail_fast=...) must list exception classes")
        object.__setattr__(self, "fail_fast", fail_fast)

    @property
    def max_attempts(self) -> int:
        """How many times a message is handled at most."""
        return 1 + self.immediate + len(self.delayed)


def _as_tuple(value: object, name: str, what: str) -> tuple[Any, ...]:
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigurationError(f"RetryPolicy({name}=...) must be a list of {what}") from None


def attempts_made(envelope: Envelope) -> int:
    """How many attempts earlier deliveries of this message made (from our own header)."""
    value = envelope.headers.get(Header.ATTEMPT)
    if value is None:
        return 0
    if len(value) > 9:
        return MAX_ATTEMPTS if value.isdigit() else 0
    try:
        return min(max(int(value), 0), MAX_ATTEMPTS)
    except ValueError:
        return 0


class RetryStep:
    """The outermost incoming step: retries failures and dead-letters what keeps failing."""

    def __init__(self, policy: RetryPolicy, backoff: float = 1.0) -> None:
        self.policy = policy
        self.backoff = backoff

    async def __call__(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Run the rest of the pipeline, retrying and dead-lettering as the policy says."""
        policy = self.policy
        made = attempts_made(context.envelope)
        first_round = 1 + policy.immediate
        context.attempt = made + 1
        while True:
            try:
                await next(context)
                return
            except Exception as error:
                context.transaction.rollback()
                made += 1
                if isinstance(error, (DecodeError, *policy.fail_fast)):
                    await self._dead_letter(context, error, made)
                    return
                if made < first_round:
                    _log_failure(context, error, made, "retrying now")
                    context.begin_attempt(made + 1)
                    continue
                step = made - first_round
                if step < len(policy.delayed):
                    await self._delay(context, error, made, policy.delayed[step])
                else:
                    await self._dead_letter(context, error, made)
                return

    async def _delay(
        self, context: MessageContext, error: Exception, made: int, seconds: float
    ) -> None:
        _log_failure(context, error, made, f"retrying in {seconds:g}s")
        envelope = context.envelope.copy(
            **{Header.ATTEMPT: str(made), Header.DELIVER_AT: f"{time.time() + seconds:.6f}"}
        )
        await self._forward(context, Outgoing(context.queue, envelope), "the delayed retry")

    async def _dead_letter(self, context: MessageContext, error: Exception, made: int) -> None:
        log.error(
            "moving %s to %r after %d attempt(s): %s: %s",
            describe(context.headers),
            self.policy.error_queue,
            made,
            type(error).__name__,
            error,
        )
        envelope = context.envelope.copy(**error_headers(error, made, context.queue))
        # A deliver-at that came with the message (forged, or left from a delay) must not hold
        # the dead letter back: transports honour it at send time (RabbitMQ: a wait queue).
        envelope.headers.pop(Header.DELIVER_AT, None)
        envelope.headers = fit_headers(envelope.headers)
        await self._forward(context, Outgoing(self.policy.error_queue, envelope), "dead-lettering")

    async def _forward(self, context: MessageContext, outgoing: Outgoing, what: str) -> None:
        try:
            await context.app.transport.send((outgoing,))
        except Exception as error:
            log.error(
                "%s of %s failed (%s: %s); returning it to %r",
                what,
                describe(context.headers),
                type(error).__name__,
                error,
                context.queue,
            )
            await asyncio.sleep(self.backoff)
            await context.delivery.nack(requeue=True)
            return
        await acknowledge(context.delivery)


def error_headers(error: BaseException, attempts: int, queue: str) -> dict[str, str]:
    """The headers that tell an operator why a message is in the error queue."""
    trace = "".join(traceback.format_exception(error))
    return {
        Header.ERROR_TYPE: f"{type(error).__module__}.{type(error).__qualname__}",
        Header.ERROR_MESSAGE: str(error)[:MAX_ERROR_TEXT],
        Header.ERROR_TRACEBACK: trace[-MAX_TRACEBACK:],
        Header.ERROR_ATTEMPTS: str(attempts),
        Header.ERROR_QUEUE: queue,
        Header.FAILED_AT: now(),
    }


def fit_headers(headers: dict[str, str], budget: int = MAX_HEADER_BYTES) -> dict[str, str]:
    """The headers with the longest values cut (and absurd names dropped) to fit `budget` bytes.

    A dead letter carries the original headers plus the error's; if those came in near the
    broker's limit, the copy would not fit, and the message could never reach the error queue.
    """
    sizes = {key: len(key.encode()) + len(value.encode()) for key, value in headers.items()}
    total = sum(sizes.values())
    if total <= budget:
        return headers
    fitted: dict[str, str] = {}
    for key, value in headers.items():
        if len(key) > CUT_TO:
            total -= sizes[key]
            continue
        fitted[key] = value
    for key in sorted(fitted, key=lambda k: sizes[k], reverse=True):
        value = fitted[key]
        if total <= budget or len(value) <= CUT_TO:
            break
        cut = f"{value[:CUT_TO]}...[{len(value) - CUT_TO} characters cut]"
        total -= sizes[key] - len(key.encode()) - len(cut.encode())
        fitted[key] = cut
    return fitted


def _log_failure(context: MessageContext, error: Exception, made: int, then: str) -> None:
    log.warning(
        "handling %s failed on attempt %d: %s: %s; %s",
        describe(context.headers),
        made,
        type(error).__name__,
        error,
        then,
    )
