"""Retries: immediate ones in process, delayed ones through the broker, then the error queue.

The policy says how often; `after_failure` decides, attempt by attempt, for the receiver
(`mersal.receiving`), which runs the attempts; `mersal.settle` carries the decision out.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mersal.context import MessageContext
from mersal.errors import ConfigurationError, DecodeError
from mersal.logs import message_fields
from mersal.messages import Envelope, Header, describe
from mersal.numbers import is_count, is_seconds
from mersal.settle import Failure, Outcome, Verdict

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
        if not is_count(self.immediate):
            raise ConfigurationError(
                f"RetryPolicy(immediate={self.immediate!r}) must be an int >= 0"
            )
        delays = _as_tuple(self.delayed, "delayed", "seconds")
        if not all(is_seconds(d) for d in delays):
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


def conflict_pause(conflicts: int) -> float:
    """A short random pause before rerunning after the `conflicts`-th conflict in a row."""
    return random.uniform(0.0, min(0.001 * 2 ** min(conflicts, 6), 0.05))


def after_failure(policy: RetryPolicy, error: BaseException, made: int) -> Outcome | None:
    """What follows the `made`-th failed attempt: None to retry at once, else the outcome."""
    if isinstance(error, (DecodeError, *policy.fail_fast)):
        return Outcome.dead_letter(Failure.of(error), made)
    first_round = 1 + policy.immediate
    if made < first_round:
        return None
    step = max(0, made - first_round)
    if step < len(policy.delayed):
        return Outcome.retry_later(policy.delayed[step], made, Failure.of(error))
    return Outcome.dead_letter(Failure.of(error), made)


def log_failure(
    context: MessageContext,
    outcome: Outcome | None,
    made: int,
    failure: Failure | None,
    error_queue: str,
) -> None:
    """Log a failed attempt: retried at WARNING, moved to `error_queue` at ERROR."""
    if outcome is not None and outcome.verdict is Verdict.DEAD_LETTER:
        log.error(
            "moving %s to %r after %d attempt(s): %s",
            describe(context.headers),
            error_queue,
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
