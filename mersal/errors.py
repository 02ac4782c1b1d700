"""The errors Mersal raises: every one is a `MersalError`."""

from __future__ import annotations


class MersalError(Exception):
    """Base of every error the framework raises."""


class ConfigurationError(MersalError):
    """The app is set up in a way that cannot work; the message says what to change."""


class Unreachable(MersalError):
    """The broker or the database did not answer: down, still starting, or a wrong host or port."""


class DecodeError(MersalError):
    """A delivery cannot become a message: bad body, unknown or missing type, too large."""


class NoHandler(DecodeError):
    """A message of a type this app decodes but has no handler for: dead-lettered, not dropped."""


class EncodeError(MersalError):
    """A message cannot be encoded (a field of a type the codec cannot carry): nothing was sent."""


class Unsendable(MersalError):
    """The broker can never take this message as it is (no such queue, too large)."""


class Unroutable(Unsendable):
    """The broker had nowhere to put a message (no such queue or binding)."""


class OutcomeUnknown(MersalError):
    """A publish was not confirmed in time: the broker may or may not have the message."""


class RequestTimeout(MersalError):
    """No reply arrived within the request's timeout."""


class UnexpectedReply(MersalError):
    """A request's reply is not of the `reply_type` it asked for."""


class NotRunning(MersalError):
    """The app must be started (`await app.start()` or `async with app`) for this call."""


class ConcurrencyConflict(MersalError):
    """Another message changed shared state (a saga) first: the attempt runs again at once."""


class ConsumerClosed(MersalError):
    """The consumer was closed (or lost for good) while waiting for a delivery."""


class Duplicate(MersalError):
    """The inbox holds the message's id: another copy of it was handled, so this one is acked.

    Only a `Duplicate` of the message being handled is acked: one raised for another id (or
    by a handler, for its own reasons) fails the attempt like any other error.
    """

    def __init__(self, message_id: str, when: str = "already") -> None:
        super().__init__(f"message {message_id} was handled {when}")
        self.message_id = message_id
