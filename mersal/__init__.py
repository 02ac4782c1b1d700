"""Mersal: an asyncio service bus with a transactional outbox."""

from mersal.distribution import refuse_unrelated

# First: where the other `mersal` project's files are installed beside ours, the modules imported
# below may be its own.
refuse_unrelated()

from mersal.app import App
from mersal.context import MessageContext, OutgoingContext
from mersal.errors import (
    ConfigurationError,
    ConsumerClosed,
    DecodeError,
    EncodeError,
    MersalError,
    NoHandler,
    NotRunning,
    OutcomeUnknown,
    RequestTimeout,
    UnexpectedReply,
    Unroutable,
    Unsendable,
)
from mersal.messages import Envelope, Header, message
from mersal.pipeline import Pipeline
from mersal.retry import RetryPolicy
from mersal.timeouts import HandlerTimeout
from mersal.transaction import TransactionClosed
from mersal.transport import Delivery, Outgoing, Transport

__all__ = [
    "App",
    "ConfigurationError",
    "ConsumerClosed",
    "DecodeError",
    "Delivery",
    "EncodeError",
    "Envelope",
    "HandlerTimeout",
    "Header",
    "MersalError",
    "MessageContext",
    "NoHandler",
    "NotRunning",
    "OutcomeUnknown",
    "Outgoing",
    "OutgoingContext",
    "Pipeline",
    "RequestTimeout",
    "RetryPolicy",
    "TransactionClosed",
    "Transport",
    "UnexpectedReply",
    "Unroutable",
    "Unsendable",
    "message",
]
