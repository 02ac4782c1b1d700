"""The message being handled and the message being sent, as steps and handlers see them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from mersal.messages import Envelope, Header
from mersal.settle import Outcome
from mersal.transaction import Transaction
from mersal.transport import Delivery

NewTransaction = Callable[[Envelope], Transaction]
"""Makes the transaction of one attempt at handling a message (the app's commit chosen)."""


class MessageContext:
    """The message being handled: its headers, decoded body, attempt, transaction and outcome.

    Steps and handlers read it; a step decides what becomes of the delivery by setting
    `outcome` (the worker settles the delivery after the pipeline, never a step).
    """

    __slots__ = (
        "_new_transaction",
        "app",
        "attempt",
        "completed",
        "conflicts",
        "delivery",
        "envelope",
        "handlers",
        "items",
        "message",
        "message_type",
        "outcome",
        "transaction",
    )

    def __init__(self, app: Any, delivery: Delivery, new_transaction: NewTransaction) -> None:
        self.app: Any = app
        """The `mersal.App` handling the message."""
        self.delivery = delivery
        self.envelope: Envelope = delivery.envelope
        self.message: Any = None
        self.message_type: type | None = None
        self.attempt = 1
        self.conflicts = 0
        """How often this attempt ran again after losing a race for shared state (a saga)."""
        self.outcome: Outcome | None = None
        self.completed = False
        """Whether the attempt went through every step (the pipeline's end was reached)."""
        self._new_transaction = new_transaction
        self.transaction = new_transaction(self.envelope)
        self.items: dict[str, Any] = {}
        self.handlers: list[Callable[[Any], Awaitable[object]]] = []

    @property
    def headers(self) -> dict[str, str]:
        """The message's headers as received."""
        return self.envelope.headers

    @property
    def message_id(self) -> str:
        """The message's id ('' for a message sent without one)."""
        return self.envelope.headers.get(Header.MESSAGE_ID, "")

    @property
    def correlation_id(self) -> str:
        """The id shared by every message of one conversation."""
        headers = self.envelope.headers
        return headers.get(Header.CORRELATION_ID) or headers.get(Header.MESSAGE_ID, "")

    @property
    def reply_to(self) -> str | None:
        """Where `app.reply` sends to."""
        return self.envelope.headers.get(Header.REPLY_TO)

    @property
    def queue(self) -> str:
        """The queue the message came from."""
        return self.delivery.queue

    def begin_attempt(self, attempt: int) -> None:
        """Start handling afresh: a new transaction, no handlers, no step state, no outcome."""
        self.attempt = attempt
        self.outcome = None
        self.completed = False
        if not self.transaction.untouched:  # the one made with the context serves attempt 1
            self.transaction = self._new_transaction(self.envelope)
            self.items.clear()
            self.handlers.clear()


@dataclass(slots=True)
class OutgoingContext:
    """A message being sent: its destination, headers, and (once serialized) its envelope."""

    message: object
    address: str
    publish: bool
    headers: dict[str, str]
    incoming: MessageContext | None
    transaction: Transaction | None
    envelope: Envelope = field(default_factory=lambda: Envelope({}, b""))


current_message: ContextVar[MessageContext | None] = ContextVar("mersal_message", default=None)
"""The message whose attempt is running (in its handlers and the tasks they start)."""
