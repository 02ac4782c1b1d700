"""The incoming and outgoing pipelines: named steps, each calling the next."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, Protocol, TypeVar
from uuid import UUID

from mersal.context import MessageContext, OutgoingContext
from mersal.errors import ConfigurationError, DecodeError, NoHandler, Unsendable
from mersal.handlers import Handlers
from mersal.messages import Envelope, Header, TypeRegistry, new_id
from mersal.serialization import Codec
from mersal.timeouts import HandlerClock, HandlerTimeout
from mersal.transport import Outgoing, Transport
from mersal.transport.limits import check_sendable, limits_of, plainly_sendable

log = logging.getLogger("mersal.pipeline")

RETRY_HINT = (
    ": retries are not a step; every incoming step runs once per attempt, inside the retry "
    "loop (mersal.receiving), so put a step first with insert_before('decode', ...)"
)

C = TypeVar("C")
Next = Callable[[C], Awaitable[None]]
Step = Callable[[C, Next[C]], Awaitable[None]]


class Pipeline(Generic[C]):
    """An ordered list of named steps; each receives the context and the rest of the chain.

    `end` runs after the last step, when every step called the next one.
    """

    def __init__(self, steps: list[tuple[str, Step[C]]], end: Next[C] | None = None) -> None:
        self._steps = list(steps)
        if len(set(self.names)) != len(self._steps):
            raise ConfigurationError(f"pipeline step names must be unique: {self.names}")
        self._end: Next[C] = end if end is not None else _end
        self._chain: Next[C] | None = None

    @property
    def names(self) -> list[str]:
        """The step names, in order."""
        return [name for name, _ in self._steps]

    def insert_before(self, anchor: str, name: str, step: Step[C]) -> None:
        """Run `step` just before the step named `anchor`."""
        self._insert(self._index(anchor), name, step)

    def insert_after(self, anchor: str, name: str, step: Step[C]) -> None:
        """Run `step` just after the step named `anchor`."""
        self._insert(self._index(anchor) + 1, name, step)

    def replace(self, name: str, step: Step[C]) -> None:
        """Swap the step named `name` for another."""
        self._check_open()
        self._steps[self._index(name)] = (name, step)

    def remove(self, name: str) -> None:
        """Drop the step named `name`."""
        self._check_open()
        del self._steps[self._index(name)]

    async def run(self, context: C) -> None:
        """Pass `context` through every step."""
        chain = self._chain
        if chain is None:
            chain = self.freeze()
        await chain(context)

    def freeze(self) -> Next[C]:
        """Compose the steps into one callable; the pipeline can no longer change."""
        if self._chain is None:
            chain: Next[C] = self._end
            for _, step in reversed(self._steps):
                chain = _link(step, chain)
            self._chain = chain
        return self._chain

    def _insert(self, index: int, name: str, step: Step[C]) -> None:
        self._check_open()
        if name in self.names:
            raise ConfigurationError(f"the pipeline already has a step named {name!r}")
        self._steps.insert(index, (name, step))

    def _index(self, name: str) -> int:
        for index, (existing, _) in enumerate(self._steps):
            if existing == name:
                return index
        hint = RETRY_HINT if name == "retry" else ""
        raise ConfigurationError(
            f"no pipeline step named {name!r}; the steps are {self.names}{hint}"
        )

    def _check_open(self) -> None:
        if self._chain is not None:
            raise ConfigurationError("change the pipeline before the app starts")


def _link(step: Step[C], rest: Next[C]) -> Next[C]:
    def call(context: C) -> Awaitable[None]:
        return step(context, rest)

    return call


async def _end(context: object) -> None:
    return None


async def completed(context: MessageContext) -> None:
    """The end of the incoming pipeline: every step ran, so the message was dealt with."""
    context.completed = True


# The assembly: every step that runs, in order.


def incoming_pipeline(
    codec: Codec,
    types: TypeRegistry,
    handlers: Handlers,
    clock: HandlerClock,
    max_body_size: int,
) -> Pipeline[MessageContext]:
    """The steps each attempt at a delivery goes through; a storage adds its own
    (`add_storage_steps`). The attempts are run, and what they raise judged, by
    `mersal.receiving`, outside every step."""
    return Pipeline(
        [
            ("decode", decode_step(codec, types, max_body_size)),
            # with a storage: ("unit_of_work", ...), ("inbox", ...)
            ("activate", activate_step(handlers)),
            ("dispatch", dispatch_step(clock)),
            ("commit", commit_step),
        ],
        end=completed,
    )


def add_storage_steps(incoming: Pipeline[MessageContext], storage: StorageSteps) -> None:
    """Place a storage's steps: its unit of work right after decoding, then its inbox check.

    A `ConfigurationError` says what to change if the pipeline no longer has the anchor; the
    pipeline is left as it was.
    """
    if "decode" not in incoming.names:
        raise ConfigurationError(
            "a storage places its unit of work and inbox steps right after 'decode', which "
            f"app.incoming no longer has (its steps: {incoming.names}): keep a step named 'decode'"
        )
    taken = [name for name in ("unit_of_work", "inbox") if name in incoming.names]
    if taken:
        raise ConfigurationError(
            f"app.incoming already has a step named {taken[0]!r}, a name the storage's step "
            "needs: rename yours"
        )
    incoming.insert_after("decode", "unit_of_work", storage.unit_of_work)
    incoming.insert_after("unit_of_work", "inbox", storage.check_inbox)


def outgoing_pipeline(
    types: TypeRegistry,
    queue: str,
    codec: Codec,
    transport_now: Callable[[], Transport],
    *,
    replies: bool = True,
) -> Pipeline[OutgoingContext]:
    """The steps every send goes through, from message object to transport (or transaction).

    `replies`: whether replies can come back to `queue` (not for a send-only app).
    """
    return Pipeline(
        [
            ("headers", headers_step(types, queue, codec.content_type, replies=replies)),
            ("correlation", correlation_step),
            ("serialize", serialize_step(codec)),
            ("send", send_step(transport_now)),
        ]
    )


class StorageSteps(Protocol):
    """The steps a storage brings to the incoming pipeline."""

    async def unit_of_work(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Run the rest of the attempt in the storage's transaction (a session per message)."""
        ...

    async def check_inbox(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Skip a message whose id the inbox already holds."""
        ...


# The incoming steps the core provides.


def decode_step(codec: Codec, types: TypeRegistry, max_body_size: int) -> Step[MessageContext]:
    """Turn the envelope into a message object of a registered type."""
    expected = codec.content_type

    async def decode(context: MessageContext, next: Next[MessageContext]) -> None:
        envelope = context.envelope
        if len(envelope.body) > max_body_size:
            raise DecodeError(
                f"body of {len(envelope.body)} bytes is over the {max_body_size}-byte cap"
            )
        name = envelope.headers.get(Header.TYPE)
        if not name:
            raise DecodeError("the message has no type header, so no handler can be chosen")
        content_type = envelope.headers.get(Header.CONTENT_TYPE)
        if content_type and content_type != expected and media_type(content_type) != expected:
            raise DecodeError(f"content type {content_type!r} is not {expected!r}")
        cls = types.resolve(name)
        context.message_type = cls
        try:
            context.message = codec.decode(envelope.body, cls)
        except RecursionError:  # msgspec's answer to JSON nested deeper than the stack
            raise DecodeError(f"body nests too deeply to decode as {cls.__qualname__}") from None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("received %s on %s: %r", name, context.queue, envelope.body[:2048])
        await next(context)

    return decode


def media_type(content_type: str) -> str:
    """The media type of a content type, without parameters, in lower case."""
    return content_type.partition(";")[0].strip().lower()


def activate_step(handlers: Handlers) -> Step[MessageContext]:
    """Build the handlers of the message's type (one dependency scope per message)."""

    async def activate(context: MessageContext, next: Next[MessageContext]) -> None:
        assert context.message_type is not None
        context.handlers = handlers.activate(context.message_type, context)
        if not context.handlers:
            raise NoHandler(_no_handler(context.message_type, context.headers))
        await next(context)

    return activate


def _no_handler(message_type: type, headers: Mapping[str, str]) -> str:
    """Why no handler takes the message, and what to change: a reply's is not a route."""
    name = message_type.__qualname__
    if headers.get(Header.REPLY) == "true":
        return (
            f"no handler for {name}, a reply, in this app: a reply to a message sent with send "
            f"comes to the sender's own queue; app.register({name}, handler), or send with "
            "app.request(...) to await the reply"
        )
    return (
        f"no handler for {name} in this app: app.register({name}, handler), or route {name} to "
        "the app that handles it"
    )


def dispatch_step(clock: HandlerClock) -> Step[MessageContext]:
    """Call every handler, in registration order, all within the clock's timeout."""

    async def dispatch(context: MessageContext, next: Next[MessageContext]) -> None:
        message = context.message
        timed = clock.start()
        try:
            for handler in context.handlers:
                await handler(message)
        except BaseException:
            if clock.finish(timed):
                await clock.absorb(timed)
                raise HandlerTimeout(_too_slow(context, clock.timeout)) from None
            raise
        if clock.finish(timed):  # a handler swallowed the cancellation and returned late
            await clock.absorb(timed)
            raise HandlerTimeout(_too_slow(context, clock.timeout))
        await next(context)

    return dispatch


def _too_slow(context: MessageContext, timeout: float | None) -> str:
    name = context.message_type.__qualname__ if context.message_type else "the message"
    return (
        f"the handlers of {name} did not finish within {timeout:g}s: make them faster or "
        "raise App(handler_timeout=...)"
    )


async def commit_step(context: MessageContext, next: Next[MessageContext]) -> None:
    """Commit the message's transaction: what the handlers sent leaves now, in order."""
    await context.transaction.commit()
    await next(context)


# The outgoing steps.


def headers_step(
    types: TypeRegistry, queue: str, content_type: str, *, replies: bool = True
) -> Step[OutgoingContext]:
    """Give the message an id, its type name, a sent-at time and a reply address (`queue`).

    Without `replies` (a send-only app has no queue), no reply address unless the sender gave one.
    """

    async def add_headers(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        headers = context.headers
        if Header.MESSAGE_ID not in headers:
            transaction = context.transaction
            headers[Header.MESSAGE_ID] = (
                transaction.message_id() if transaction is not None else new_id()
            )
        headers[Header.TYPE] = types.name_of(type(context.message))
        headers[Header.SENT_AT] = now()
        headers[Header.CONTENT_TYPE] = content_type
        headers[Header.SOURCE] = queue
        if replies and Header.REPLY_TO not in headers:
            headers[Header.REPLY_TO] = queue
        await next(context)

    return add_headers


async def correlation_step(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
    """Carry the conversation: correlation id from the incoming message, causation = its id."""
    headers = context.headers
    incoming = context.incoming
    if incoming is None:
        headers.setdefault(Header.CORRELATION_ID, headers[Header.MESSAGE_ID])
    else:
        headers.setdefault(Header.CORRELATION_ID, incoming.correlation_id)
        headers.setdefault(Header.CAUSATION_ID, incoming.message_id)
    await next(context)


def serialize_step(codec: Codec) -> Step[OutgoingContext]:
    """Encode the message body into an envelope, checked to decode back if the codec can check."""
    encode = codec.encode
    validate: Callable[[object, bytes], None] | None = getattr(codec, "validate", None)

    async def serialize(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        body = encode(context.message)
        if validate is not None:
            validate(context.message, body)
        context.envelope = Envelope(context.headers, body)
        await next(context)

    return serialize


def send_step(transport_now: Callable[[], Transport]) -> Step[OutgoingContext]:
    """Refuse what the transport could never carry; buffer the rest, or send it if unbuffered.

    `transport_now` gives the app's transport (a test harness may swap it between runs).
    """

    async def send(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        transport = transport_now()
        outgoing = Outgoing(context.address, context.envelope, context.publish)
        limits = limits_of(transport)  # known once the transport is connected
        if not plainly_sendable(outgoing, limits):
            check_sendable(outgoing, limits)
        outgoing.checked = True
        if context.transaction is not None:
            context.transaction.enlist(outgoing)
        else:
            await transport.send((outgoing,))
        await next(context)

    return send


def check_headers(headers: object) -> dict[str, str]:
    """A copy of the headers a caller passed, refused (`Unsendable`) unless `str -> str`."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise Unsendable(f"headers= must be a mapping of strings to strings, not {headers!r:.100}")
    copy = dict(headers)
    for name, value in copy.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise Unsendable(
                f"header {name!r:.100}: {value!r:.100} is not a string to a string: header names "
                "and values are strings"
            )
    return copy


def partition_key_text(key: object) -> str:
    """The text a `partition_key=` travels as: a str as it is, an int or a UUID as its str."""
    if isinstance(key, str):
        return key
    if (isinstance(key, int) and not isinstance(key, bool)) or isinstance(key, UUID):
        return str(key)
    hint = (
        "key.decode() if it is text, key.hex() if it is not"
        if isinstance(key, bytes | bytearray | memoryview)
        else "str(key), if that is the same for the same key in every process"
    )
    raise Unsendable(
        f"partition_key={key!r:.100} is a {type(key).__name__}: a partition key is text "
        f"(a str; an int or a UUID is taken as its str): pass {hint}"
    )


def now() -> str:
    """The current time as the epoch-seconds string used in headers."""
    return f"{time.time():.6f}"
