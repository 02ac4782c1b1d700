"""The error queue from an operator's side: look at dead letters, send them back, or drop them.

Everything goes through the Transport protocol: messages are taken from the error queue with a
consumer and held unacknowledged while they are looked at; what is not replayed or dropped goes
back with `nack(requeue=True)`, so looking consumes nothing. A transport whose broker may count
those returns and drop a message after some (a RabbitMQ quorum queue with a delivery limit)
has a `check_give_back(queue)` method that raises `LookingWouldLose` first, and nothing is taken.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from mersal.errors import ConfigurationError, MersalError, Unroutable
from mersal.messages import Envelope, Header
from mersal.numbers import is_count
from mersal.settle import ERROR_HEADERS
from mersal.text import first_line, iso
from mersal.transport import Delivery, Outgoing, Transport

log = logging.getLogger("mersal.dead_letters")

IDLE = 0.5
"""Seconds without a new delivery after which the queue counts as read to its end."""

MAX_TAKE = 65_535
"""The most messages held at once (an AMQP prefetch count is 16 bits)."""

RETRY_HEADERS = (Header.ATTEMPT, Header.DELIVER_AT)
"""The headers of a delayed retry: the attempts made so far and when to deliver."""

TIME_HEADERS = frozenset({Header.SENT_AT, Header.FAILED_AT, Header.DELIVER_AT})
"""The headers holding a time in epoch seconds, shown also as ISO times."""

SUMMARY_COLUMNS = ("MESSAGE-ID", "TYPE", "ERROR", "ATTEMPTS", "SOURCE", "FAILED-AT", "MESSAGE")
"""The columns of `summary`, as `mersal dlq list` heads them."""


class MissingQueue(Unroutable):
    """The error queue to read does not exist."""

    def __init__(self, queue: str) -> None:
        super().__init__(f"no queue named {queue!r} to read dead letters from")
        self.queue = queue


class LookingWouldLose(ConfigurationError):
    """Messages of this error queue given back could be dropped by the broker: none was taken."""

    def __init__(self, queue: str, reason: str) -> None:
        super().__init__(f"will not take messages from {queue!r}: {reason}")
        self.queue = queue


@dataclass(frozen=True)
class DeadLetter:
    """A message in an error queue: its envelope, and why it is there."""

    envelope: Envelope

    @property
    def headers(self) -> dict[str, str]:
        """All of the message's headers, the error headers included."""
        return self.envelope.headers

    @property
    def message_id(self) -> str | None:
        """The message's id, if it has one."""
        return self.envelope.message_id

    @property
    def type_name(self) -> str | None:
        """The message's wire type name, if it has one."""
        return self.envelope.type_name

    @property
    def error_type(self) -> str | None:
        """The qualified name of the exception that made it fail."""
        return self.headers.get(Header.ERROR_TYPE)

    @property
    def error_message(self) -> str | None:
        """The failure's message."""
        return self.headers.get(Header.ERROR_MESSAGE)

    @property
    def attempts(self) -> int | None:
        """How often it was handled before it was dead-lettered."""
        try:
            return int(self.headers.get(Header.ERROR_ATTEMPTS, ""))
        except ValueError:
            return None

    @property
    def source_queue(self) -> str | None:
        """The queue it failed in, where a replay sends it."""
        return self.headers.get(Header.ERROR_QUEUE) or None

    @property
    def failed_at(self) -> datetime | None:
        """When it was dead-lettered."""
        return epoch_time(self.headers.get(Header.FAILED_AT))


def epoch_time(value: str | None) -> datetime | None:
    """A header's epoch-seconds time as a UTC datetime; None if absent or not a time."""
    if not value:
        return None
    try:
        return datetime.fromtimestamp(float(value), tz=UTC)
    except (ValueError, OverflowError, OSError):
        return None


@dataclass(frozen=True)
class FailureGroup:
    """Failures that share a cause: the exception type, its message's fixed words, the handler."""

    key: str
    """A digest of the three, the same for every failure of the group."""
    label: str
    """The group in words: `Type: message with <n> for its variable parts (in handler)`."""
    error_type: str | None
    handler: str | None


MAX_LABEL = 500
"""The most characters of a failure's message kept in its group's label."""

VARIABLE_PARTS = (
    (
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
        "<id>",
    ),
    (
        re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"),
        "<time>",
    ),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<address>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{16,}\b"), "<id>"),
    # A quoted name (a key, an attribute) tells causes apart; quoted values with digits, spaces
    # or punctuation vary. An apostrophe inside a word (can't) opens no quote.
    (re.compile(r"(?<!\w)'(?![A-Za-z_][\w.]{0,39}'(?!\w))[^']*'(?!\w)"), "<text>"),
    (re.compile(r'"(?![A-Za-z_][\w.]{0,39}")[^"]*"'), "<text>"),
    (re.compile(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:[a-zA-Z]{1,3}\b)?"), "<n>"),
    (re.compile(r"\b(?=[A-Za-z_]*\d)(?=\d*[A-Za-z_])[A-Za-z0-9_]{2,}\b"), "<id>"),
)
"""What varies from one failure of a cause to the next, each with what it becomes in the group."""

FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+, in (?P<function>.+)$', re.MULTILINE)
SEPARATOR = re.compile(r"[/\\]")
DISPATCH = re.compile(r"[/\\]mersal[/\\]pipeline\.py$")
WRAPPERS = re.compile(r"[/\\](?:mersal[/\\](?:binding|handlers|sagas)\.py|lagom[/\\].*)$")


def normalized(message: str) -> str:
    """`message` with its ids, numbers, times and quoted values replaced by placeholders."""
    text = " ".join(message.split())
    for pattern, placeholder in VARIABLE_PARTS:
        text = pattern.sub(placeholder, text)
    return text[:MAX_LABEL]


def failing_handler(traceback: str | None) -> str | None:
    """`package/file.py:function` of the handler the last traceback passes through, if any.

    The handler's frame is the first after the pipeline's dispatch step that is not one of the
    framework's wrappers; a failure outside the handlers (decoding, say) has none.
    """
    if not traceback:
        return None
    last = traceback.rpartition("Traceback (most recent call last):")[2]
    frames = [(m["path"], m["function"].strip()) for m in FRAME.finditer(last)]
    dispatched = [i for i, (path, function) in enumerate(frames) if DISPATCH.search(path)]
    if not dispatched:
        return None
    for path, function in frames[dispatched[-1] + 1 :]:
        if not WRAPPERS.search(path):
            return f"{'/'.join(SEPARATOR.split(path)[-2:])}:{function}"
    return None


def failure_group(letter: DeadLetter) -> FailureGroup:
    """The group of failures `letter` belongs to."""
    error_type = letter.error_type
    handler = failing_handler(letter.headers.get(Header.ERROR_TRACEBACK))
    message = normalized(letter.error_message or "")
    named = (error_type or "no error type").rpartition(".")[2]
    label = f"{named}: {message}" if message else named
    type_name = letter.headers.get(Header.TYPE, "")
    if handler:
        label = f"{label} (in {handler})"
    elif type_name:
        label = f"{label} (on {type_name})"
    parts = (error_type or "", message, handler or "", type_name)
    digest = hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass"))
    return FailureGroup(digest.hexdigest(), label, error_type, handler)


def letter_key(queue: str, envelope: Envelope) -> str:
    """A digest of a dead letter as it came from `queue`: the same for each delivery of it."""
    digest = hashlib.sha256(queue.encode("utf-8", "surrogatepass"))
    for name in sorted(envelope.headers):
        digest.update(b"\0" + name.encode("utf-8", "surrogatepass"))
        digest.update(b"\1" + envelope.headers[name].encode("utf-8", "surrogatepass"))
    digest.update(b"\2" + envelope.body)
    return digest.hexdigest()


def summary(letter: DeadLetter) -> tuple[str, ...]:
    """The cells of `letter`'s line in `mersal dlq list` (see SUMMARY_COLUMNS)."""
    attempts = letter.attempts
    return (
        letter.message_id or "-",
        letter.type_name or "-",
        letter.error_type or "-",
        "-" if attempts is None else str(attempts),
        letter.source_queue or "-",
        iso(letter.failed_at),
        first_line(letter.error_message),
    )


def details(letter: DeadLetter) -> str:
    """Every header and the body of a dead letter, as text for an operator."""
    lines = ["headers:"]
    for name in sorted(letter.headers):
        value = letter.headers[name]
        if name in TIME_HEADERS and (moment := epoch_time(value)) is not None:
            value = f"{value} ({iso(moment)})"
        first, *rest = value.splitlines() or [""]
        lines.append(f"  {printable(name)}: {printable(first)}")
        lines.extend(f"      {printable(line)}" for line in rest)
    lines.append(f"body ({len(letter.envelope.body)} bytes):")
    lines.append(body_text(letter.envelope.body))
    return "\n".join(lines)


def printable(text: str) -> str:
    """`text` with what a terminal would act on (escape sequences, control characters) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def body_text(body: bytes) -> str:
    """The body as indented JSON if it is UTF-8 JSON, else its Python repr."""
    try:
        decoded = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return repr(body)
    return json.dumps(decoded, indent=2, ensure_ascii=False)


def chosen(
    letter: DeadLetter,
    message_ids: Collection[str] | None = None,
    type_name: str | None = None,
    error: str | None = None,
) -> bool:
    """Whether `letter` has one of the ids, the type, and the text in its error (None: any)."""
    if message_ids is not None and letter.message_id not in message_ids:
        return False
    if type_name is not None and letter.type_name != type_name:
        return False
    if error is None:
        return True
    return error in (letter.error_type or "") or error in (letter.error_message or "")


def replayable(envelope: Envelope) -> Envelope:
    """The envelope without the error and retry headers: sent again, it gets every retry anew.

    The message id stays, so an app with an inbox that did handle a copy skips this one. The
    `replays` header counts one more replay: an app that remembers how the failed delivery was
    to end (its dead letter could not leave) tells the replay from that delivery coming back.
    """
    headers = {
        name: value
        for name, value in envelope.headers.items()
        if name not in ERROR_HEADERS and name not in RETRY_HEADERS
    }
    headers[Header.REPLAYS] = str(replays(envelope) + 1)
    return Envelope(headers, envelope.body)


def replays(envelope: Envelope) -> int:
    """How often the message was replayed (0 without a readable `replays` header)."""
    try:
        return max(int(envelope.headers.get(Header.REPLAYS, "0")), 0)
    except ValueError:
        return 0


@dataclass(eq=False)
class Held:
    """A dead letter taken from its queue: acked once replayed, otherwise given back."""

    delivery: Delivery
    letter: DeadLetter
    settled: bool = False

    async def ack(self) -> None:
        """Remove the message from the error queue for good."""
        self.settled = True
        await self.delivery.ack()

    async def give_back(self) -> None:
        """Give the message back to the error queue, in its place (once; later calls do nothing)."""
        if self.settled:
            return
        self.settled = True
        try:
            await self.delivery.nack(requeue=True)
        except Exception as error:  # the broker gives it back anyway when the connection closes
            log.warning(
                "could not give %s back to %r (%s: %s); the broker gives it back when the "
                "connection closes",
                self.letter.message_id,
                self.delivery.queue,
                type(error).__name__,
                error,
            )


@dataclass(frozen=True)
class Replay:
    """What became of one dead letter chosen for replay."""

    letter: DeadLetter
    queue: str | None
    sent: bool
    problem: str | None = None

    @property
    def done(self) -> bool:
        """Whether it was sent and removed from the error queue."""
        return self.sent and self.problem is None


@dataclass(frozen=True)
class Drop:
    """What became of one dead letter chosen to be dropped."""

    letter: DeadLetter
    problem: str | None = None

    @property
    def done(self) -> bool:
        """Whether it was removed from the error queue for good."""
        return self.problem is None


Progress = Callable[[int, int], None]
"""Told `(done, total)` after each message a replay or a drop has gone through."""

Confirm = Callable[[Sequence[DeadLetter]], Awaitable[bool]]
"""Shown the messages chosen to be dropped before any is; unless it returns True, none is."""

T = TypeVar("T")


class DeadLetters:
    """The messages of one error queue, looked at, replayed and dropped through a started transport.

    The transport must acknowledge deliveries explicitly (RabbitMQ's default `ack_mode`): with
    acks on receipt, looking at a message would remove it.
    """

    def __init__(self, transport: Transport, queue: str = "error", *, idle: float = IDLE) -> None:
        if not queue or not isinstance(queue, str):
            raise ConfigurationError("DeadLetters(queue=...) must name the error queue")
        if not idle > 0:
            raise ConfigurationError(f"DeadLetters(idle={idle!r}) must be > 0 seconds")
        self.transport = transport
        self.queue = queue
        self.idle = idle

    @asynccontextmanager
    async def take(self, limit: int) -> AsyncIterator[list[Held]]:
        """Hold up to `limit` messages, oldest first; on exit, those not acked go back.

        Taking stops at `limit` messages or once no delivery came for `idle` seconds.
        """
        check_limit(limit)
        check = getattr(self.transport, "check_give_back", None)
        if check is not None:  # the transport knows when a return could lose a message
            await check(self.queue)
        try:
            consumer = await self.transport.consume(self.queue, prefetch=limit)
        except Unroutable:
            raise MissingQueue(self.queue) from None
        held: list[Held] = []
        try:
            while len(held) < limit:
                try:
                    async with asyncio.timeout(self.idle):
                        delivery = await consumer.get()
                except TimeoutError:
                    break
                held.append(Held(delivery, DeadLetter(delivery.envelope.copy())))
            yield held
        finally:
            await consumer.close()  # first, so that what goes back is not delivered to us again
            for item in held:
                await item.give_back()

    async def peek(self, limit: int = 100) -> list[DeadLetter]:
        """Up to `limit` messages of the queue, oldest first, all left in it."""
        async with self.take(limit) as held:
            return [item.letter for item in held]

    async def find(self, message_ids: Collection[str], *, limit: int = 1_000) -> list[DeadLetter]:
        """The messages with these ids among the first `limit`, all left in the queue."""
        async with self.take(limit) as held:
            return [item.letter for item in held if item.letter.message_id in message_ids]

    async def replay(
        self,
        message_ids: Collection[str] | None = None,
        *,
        to: str | None = None,
        limit: int = 1_000,
        progress: Progress | None = None,
    ) -> list[Replay]:
        """Send messages back to their source queue (or `to`), each acked once the send returned.

        `message_ids=None` replays every message among the first `limit`. The others, and
        those that could not be sent, stay in the error queue.
        """
        async with self.take(limit) as held:
            picked = [item for item in held if chosen(item.letter, message_ids)]
            return await one_by_one(picked, lambda item: self._replay(item, to), progress)

    async def _replay(self, item: Held, to: str | None) -> Replay:
        letter = item.letter
        queue = to or letter.source_queue
        if queue is None:
            problem = f"it has no {Header.ERROR_QUEUE} header: name the queue to replay it to"
            return Replay(letter, None, sent=False, problem=problem)
        if queue == self.queue:
            return Replay(letter, queue, sent=False, problem="that is the error queue itself")
        try:
            await self.transport.send([Outgoing(queue, replayable(letter.envelope))])
        except MersalError as error:
            return Replay(letter, queue, sent=False, problem=f"{type(error).__name__}: {error}")
        try:
            await item.ack()
        except MersalError as error:
            problem = (
                f"sent, but it could not be removed from {self.queue!r} ({error}); it will "
                "be there again"
            )
            return Replay(letter, queue, sent=True, problem=problem)
        return Replay(letter, queue, sent=True)

    async def drop(
        self,
        message_ids: Collection[str] | None = None,
        *,
        type_name: str | None = None,
        error: str | None = None,
        limit: int = 1_000,
        confirm: Confirm | None = None,
        progress: Progress | None = None,
    ) -> list[Drop]:
        """Remove the chosen messages from the error queue for good; the others stay, in place.

        Chosen among the first `limit`: those with one of `message_ids`, of type `type_name`
        and with `error` in their error type or message (each None: any, so with none given,
        every message). `confirm` sees the chosen ones first; unless it says yes, none is
        dropped and the result is empty.
        """
        async with self.take(limit) as held:
            picked = [item for item in held if chosen(item.letter, message_ids, type_name, error)]
            if not picked:
                return []
            if confirm is not None and not await confirm([item.letter for item in picked]):
                return []
            return await one_by_one(picked, self._drop, progress)

    async def _drop(self, item: Held) -> Drop:
        try:
            await item.ack()
        except MersalError as error:
            problem = (
                f"it could not be removed from {self.queue!r} ({error}); it will be there again"
            )
            return Drop(item.letter, problem)
        return Drop(item.letter)


async def one_by_one(
    items: Sequence[Held],
    act: Callable[[Held], Awaitable[T]],
    progress: Progress | None = None,
) -> list[T]:
    """`act` on each item in turn, telling `progress` after each; the results in order."""
    results: list[T] = []
    for item in items:
        results.append(await act(item))
        if progress is not None:
            progress(len(results), len(items))
    return results


def check_limit(limit: int) -> None:
    """A ConfigurationError unless 1 <= limit <= MAX_TAKE."""
    if not is_count(limit, 1, MAX_TAKE):
        raise ConfigurationError(f"limit={limit!r} must be a whole number from 1 to {MAX_TAKE}")
