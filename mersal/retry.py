"""Retries: immediate ones in process, delayed ones through the broker, then the error queue.

The policy says how often; the retry step decides, attempt by attempt; `mersal.settle` carries
the decision out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mersal.errors import ConcurrencyConflict, ConfigurationError, DecodeError
from mersal.logs import message_fields
from mersal.messages import Envelope, Header, describe
from mersal.pipeline import MessageContext, Next, current_message
from mersal.settle import Failure, Outcome, Verdict, absorb_cancellation, cancelled_by_owner
from mersal.transaction import current_transaction

log = logging.getLogger("mersal.retry")

MAX_ATTEMPTS = 1_000

MAX_CONFLICTS = 1_000
"""Reruns after a concurrency conflict before the conflict counts as an attempt's failure."""


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
    """The outermost incoming step: runs attempts and decides what a failure leads to.

    Every way an attempt can end counts: a return, any exception (a `BaseException` too), a
    `CancelledError` the handler raised itself, a handler timeout. Only the worker's own stop
    cancels without counting. The step only decides (`context.outcome`); the worker settles.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    async def __call__(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Run the rest of the pipeline per attempt until one succeeds or the policy decides.

        Each attempt runs with its own transaction current; when the attempt ends, so does the
        transaction, committed or not: a task the handler left behind that sends later gets
        `TransactionClosed`.
        """
        made = attempts_made(context.envelope)
        conflicts = 0
        while True:
            context.begin_attempt(made + 1)
            context.conflicts = conflicts
            transaction = context.transaction
            message_token = current_message.set(context)
            transaction_token = current_transaction.set(transaction)
            try:
                await next(context)
                return
            except asyncio.CancelledError as cancelled:
                if cancelled_by_owner():
                    raise
                absorb_cancellation()
                error: BaseException = cancelled
            except BaseException as failed:
                error = failed
            finally:
                transaction.rollback()
                current_transaction.reset(transaction_token)
                current_message.reset(message_token)
            if isinstance(error, ConcurrencyConflict) and conflicts < MAX_CONFLICTS:
                conflicts += 1
                log.debug("%s: %s; running it again", describe(context.headers), error)
                await asyncio.sleep(conflict_pause(conflicts))
                continue
            made += 1
            outcome = after_failure(self.policy, error, made)
            log_failure(context, outcome, made, Failure.of(error) if outcome is None else None)
            if outcome is not None:
                context.outcome = outcome
                return


def conflict_pause(conflicts: int) -> float:
    """A short random pause before rerunning after the `conflicts`-th conflict in a row."""
    return random.uniform(0.0, min(0.001 * 2 ** min(conflicts, 6), 0.05))


def after_failure(
    policy: RetryPolicy, error: BaseException, made: int, *, immediate: bool = True
) -> Outcome | None:
    """What follows the `made`-th failed attempt: None to retry at once, else the outcome."""
    failure = Failure.of(error)
    if isinstance(error, (DecodeError, *policy.fail_fast)):
        return Outcome.dead_letter(failure, made)
    first_round = 1 + policy.immediate
    if immediate and made < first_round:
        return None
    step = max(0, made - first_round)
    if step < len(policy.delayed):
        return Outcome.retry_later(policy.delayed[step], made, failure)
    return Outcome.dead_letter(failure, made)


def log_failure(
    context: MessageContext, outcome: Outcome | None, made: int, failure: Failure | None = None
) -> None:
    """Log a failed attempt (`failure`, or the outcome's): retried at WARNING, dead at ERROR."""
    if failure is None and outcome is not None:
        failure = outcome.failure
    if outcome is not None and outcome.verdict is Verdict.DEAD_LETTER:
        log.error(
            "moving %s to %r after %d attempt(s): %s",
            describe(context.headers),
            context.app.retry.error_queue,
            made,
            failure,
            extra={**message_fields(context), "attempt": made},
        )
        return
    then = "retrying now" if outcome is None else f"retrying in {outcome.delay:g}s"
    log.warning(
        "handling %s failed on attempt %d: %s; %s",
        describe(context.headers),
        made,
        failure,
        then,
        extra={**message_fields(context), "attempt": made},
    )
