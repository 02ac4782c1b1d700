"""What the AMQP libraries raise, said the way Mersal says it: lost channels, failed connects.

aiormq fails a call whose channel or connection closed under it in several ways (its own
errors, a RuntimeError or a bare Exception from a closing connection, a CancelledError when
aio-pika closes it); `closed_under` tells those from real errors. A failed connect becomes the
`MersalError` that names what to fix.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import aiormq
from aio_pika.connection import make_url

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.urls import mask

CHANNEL_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
"""What a channel raises when it, or its connection, closed under the caller."""


def closed_under(error: BaseException, closed: bool, what: str) -> ConnectionError | None:
    """`error` as a lost connection, if aiormq raised it for a close mid-call; else None.

    A closing connection fails what is pending on it with a RuntimeError or a bare Exception
    (`closed` tells those from other errors), or, when aio-pika closes it (at app.stop()),
    with a CancelledError in a task that nobody cancelled.
    """
    if isinstance(error, CHANNEL_ERRORS):
        return None
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return None
    elif not (closed and isinstance(error, Exception)):
        return None
    return ConnectionError(f"{what} ({why(error)})")


def why(error: BaseException | None) -> str:
    """An error for a message or a log line: its type and text, or that none was given."""
    if error is None:
        return "no reason given"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__}, no reason given"


def connect_failure(address: str, error: Exception, reason: str) -> MersalError:
    """The error for a failed connect: `Unreachable` when nothing answered, else what refused.

    `reason` says why the attempt failed, for an unreachable node.
    """
    user, vhost = _login_of(address)
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return ConfigurationError(
            f"RabbitMQ at {mask(address)} refused the login for user {user!r}: check the user "
            "name and password"
        )
    if isinstance(error, aiormq.exceptions.InvalidFrameError) and "Connection.OpenOk" in str(
        error
    ):  # RabbitMQ answered Connection.Open with Connection.Close: the vhost is the trouble
        return ConfigurationError(
            f"RabbitMQ at {mask(address)} refused to open the vhost: vhost {vhost!r} does not "
            f"exist or user {user!r} may not use it; fix the vhost in the URL, or create it and "
            f"let the user in (rabbitmqctl add_vhost {vhost}; rabbitmqctl set_permissions -p "
            f"{vhost} {user} '.*' '.*' '.*')"
        )
    if isinstance(error, ssl.SSLError) or isinstance(error.__cause__, ssl.SSLError):
        return ConfigurationError(
            f"the TLS handshake with RabbitMQ at {mask(address)} failed "
            f"({type(error).__name__}: {error}): check the port (5671 for amqps), the server's "
            "certificate and the CA the client trusts (?cafile=... in the URL)"
        )
    if isinstance(error, OSError) or isinstance(error.__cause__, OSError):
        return Unreachable(
            f"cannot connect to RabbitMQ at {mask(address)}: {reason}; "
            "is it running, and are the host and port right?"
        )
    return MersalError(
        f"cannot connect to RabbitMQ at {mask(address)}: {type(error).__name__}: {error}; "
        "check the URL, the vhost and the credentials"
    )


def worst(failures: Sequence[MersalError]) -> MersalError:
    """The error to raise when no node answered: a refusal before an unreachable node."""
    for failure in failures:
        if not isinstance(failure, Unreachable):
            return failure
    if len(failures) == 1:
        return failures[0]
    return Unreachable(
        f"cannot connect to any of {len(failures)} RabbitMQ nodes: "
        + "; ".join(str(failure) for failure in failures)
    )


def _login_of(address: str) -> tuple[str, str]:
    """The user name and vhost an AMQP URL logs in with (aio-pika's defaults: guest, /)."""
    url = make_url(address)
    return url.user or "guest", url.path[1:].replace("%2F", "/") or "/"
