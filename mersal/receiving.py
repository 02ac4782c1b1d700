"""Receiving: a delivery becomes an `Outcome` here, and only here.

The worker hands each delivery to a `Receiver`, which runs the incoming pipeline once per
attempt. Whatever an attempt raises (any exception, a `CancelledError` the handler raised
itself, a handler timeout) counts as one failed attempt, and the retry policy says, once per
failed attempt, whether to try again at once or what the delivery comes to
(`retry.after_failure`). An attempt that raises nothing ends as a step decided
(`context.outcome`), as handled once it went through every step, or as dead-lettered if a step
stopped it without a decision. The outcome is then carried out by `settle.Settler`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from mersal.context import MessageContext, NewTransaction, current_message
from mersal.errors import ConcurrencyConflict, Duplicate
from mersal.logs import log_handled
from mersal.messages import describe
from mersal.observer import Observer
from mersal.pipeline import Pipeline
from mersal.retry import (
    MAX_CONFLICTS,
    RetryPolicy,
    after_failure,
    attempts_made,
    conflict_pause,
    log_failure,
)
from mersal.settle import (
    ACK,
    Failure,
    Outcome,
    Settler,
    absorb_cancellation,
    cancelled_by_owner,
)
from mersal.transaction import current_transaction
from mersal.transport import Delivery

log = logging.getLogger("mersal.receiving")

STOPPED_SHORT = Failure(
    "mersal.errors.MersalError",
    "the incoming pipeline ended early and no step decided what becomes of the message: a step "
    "that does not call next must set context.outcome",
)

FAULT_PAUSE = 1.0
"""Seconds before a delivery goes back to its queue after a fault of Mersal's own."""


class Receiver:
    """Turns each delivery into the outcome its attempts come to (the worker's `Receive`)."""

    def __init__(
        self,
        app: Any,
        pipeline: Pipeline[MessageContext],
        policy: RetryPolicy,
        settler: Settler,
        new_transaction: NewTransaction,
        *,
        observer: Observer | None = None,
        log_messages: bool = False,
    ) -> None:
        self.app = app
        self.pipeline = pipeline
        self.policy = policy
        self.settler = settler
        self.new_transaction = new_transaction
        self.observer = observer
        self.log_messages = log_messages
        """Log an INFO line per handled message (`mersal.handled`)."""

    def __call__(self, delivery: Delivery) -> Awaitable[Outcome]:
        """The outcome of handling `delivery`; never raises but for the worker's own stop."""
        try:
            unsent = self.settler.unsent(delivery)
            if unsent is not None:  # handled before; its retry or dead letter is what is left
                return _ready(unsent)
            context = MessageContext(self.app, delivery, self.new_transaction)
        except Exception as error:
            return _ready(_fault(delivery, Failure.of(error)))
        return self._receive(context)

    async def _receive(self, context: MessageContext) -> Outcome:
        started = time.perf_counter()
        self._tell("received", context)
        try:
            outcome = await self._attempts(context)
        except asyncio.CancelledError:
            if cancelled_by_owner():
                raise
            absorb_cancellation()
            outcome = _fault(context.delivery, "cancelled between attempts")
        except BaseException as error:
            outcome = _fault(context.delivery, Failure.of(error))
        self._tell("decided", context, outcome)
        if self.log_messages:
            log_handled(context, outcome, started)
        return outcome

    async def _attempts(self, context: MessageContext) -> Outcome:
        """Run attempts until one ends or the policy decides; a lost race reruns for free."""
        made = attempts_made(context.envelope)
        conflicts = 0
        while True:
            context.begin_attempt(made + 1)
            context.conflicts = conflicts
            error = await self._attempt(context)
            if error is None:
                return self._decision(context)
            if isinstance(error, ConcurrencyConflict) and conflicts < MAX_CONFLICTS:
                conflicts += 1
                log.debug("%s: %s; running it again", describe(context.headers), error)
                await asyncio.sleep(conflict_pause(conflicts))
                continue
            if isinstance(error, Duplicate) and error.message_id == context.message_id:
                return self._duplicate(context)
            made += 1
            outcome = after_failure(self.policy, error, made)
            failure = Failure.of(error) if outcome is None else outcome.failure
            log_failure(context, outcome, made, failure, self.policy.error_queue)
            if outcome is not None:
                return outcome

    async def _attempt(self, context: MessageContext) -> BaseException | None:
        """One run of the pipeline with its transaction current; what it raised, if anything.

        When the attempt ends, so does its transaction, committed or not: a task the handler
        left behind that sends later gets `TransactionClosed`.
        """
        transaction = context.transaction
        message_token = current_message.set(context)
        transaction_token = current_transaction.set(transaction)
        try:
            await self.pipeline.run(context)
        except asyncio.CancelledError as cancelled:
            if cancelled_by_owner():
                raise
            absorb_cancellation()
            return cancelled
        except BaseException as failed:
            if cancelled_by_owner():  # the stop's cancellation, turned into another error
                raise asyncio.CancelledError from failed
            return failed
        finally:
            transaction.rollback()
            current_transaction.reset(transaction_token)
            current_message.reset(message_token)
        return None

    def _decision(self, context: MessageContext) -> Outcome:
        """What an attempt that raised nothing comes to: a step's decision, handled, or stopped."""
        if context.outcome is not None:
            return context.outcome
        if context.completed:
            return ACK
        outcome = Outcome.dead_letter(STOPPED_SHORT, context.attempt)
        log_failure(context, outcome, outcome.attempts, STOPPED_SHORT, self.policy.error_queue)
        return outcome

    def _duplicate(self, context: MessageContext) -> Outcome:
        log.info(
            "duplicate %s skipped: app %r handled it already",
            describe(context.headers),
            self.app.name,
        )
        self._tell("skipped_duplicate", context)
        return ACK

    def _tell(self, event: str, *args: object) -> None:
        """Report `event` to the observer, if any; its failure is logged, never the message's."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except BaseException as error:  # a report never decides what becomes of a message
            log.warning("an observer failed (%s); the message goes on", Failure.of(error))


def _fault(delivery: Delivery, why: object) -> Outcome:
    """A fault of Mersal's own around the attempts: the delivery goes back, a little later."""
    log.error(
        "unexpected failure around %s (%s); giving it back in %gs",
        describe(delivery.envelope.headers),
        why,
        FAULT_PAUSE,
    )
    return Outcome.give_back(FAULT_PAUSE)


async def _ready(outcome: Outcome) -> Outcome:
    return outcome
