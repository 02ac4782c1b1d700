"""Envelopes, the header names they carry, and the registry of message types."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mersal.errors import ConfigurationError, DecodeError, EncodeError
from mersal.serialization import a_type

T = TypeVar("T", bound=type)

NAME_ATTRIBUTE = "__mersal_name__"


class Header:
    """The names of the headers Mersal reads and writes."""

    MESSAGE_ID = "message-id"
    TYPE = "type"
    CORRELATION_ID = "correlation-id"
    CAUSATION_ID = "causation-id"
    SENT_AT = "sent-at"
    REPLY_TO = "reply-to"
    ATTEMPT = "attempt"
    DELIVER_AT = "deliver-at"
    PARTITION_KEY = "partition-key"
    CONTENT_TYPE = "content-type"
    SOURCE = "source"
    ERROR_TYPE = "error-type"
    ERROR_MESSAGE = "error-message"
    ERROR_TRACEBACK = "error-traceback"
    ERROR_ATTEMPTS = "error-attempts"
    ERROR_QUEUE = "error-source-queue"
    FAILED_AT = "failed-at"
    REPLAYS = "replays"
    """How often the message was replayed from an error queue: each replay is a fresh try."""
    SAGA_ID = "saga-id"
    """On a saga's timeout: the id of the saga instance it goes back to."""
    SAGA_TYPE = "saga-type"
    """On a saga's timeout: the name of the saga type it goes back to."""
    SAGA_CHECK = "saga-check"
    """On a saga's timeout: a digest of its saga type and id, which tells it from made-up ones."""
    TEMPORARY_REPLY_TO = "temporary-reply-to"
    """"true" on a request whose reply-to queue goes away with the requester, and on its reply."""
    REPLY = "reply"
    """"true" on a message sent by `app.reply` (metrics name every reply's destination alike)."""


KEY_LENGTH = 255
"""The longest text a key column holds as it is (message ids in the inbox, saga correlations)."""


def stored_key(text: str) -> str:
    """`text` as a key column stores it: itself, or a digest if too long or holding NUL.

    The column holds up to 255 characters of text without NUL (PostgreSQL refuses NUL).
    """
    if len(text) <= KEY_LENGTH and "\x00" not in text:
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


IDS_PER_DRAW = 256
_random = b""
_used = 0


def new_id() -> str:
    """A new random message id: a version 4 UUID as text (random bytes drawn 256 ids at a time)."""
    global _random, _used
    if _used >= len(_random):
        _random, _used = os.urandom(16 * IDS_PER_DRAW), 0
    digits = _random[_used : _used + 16].hex()
    _used += 16
    return _as_uuid(digits, "4")


def derived_id(namespace: bytes, name: str) -> str:
    """The version 5 UUID of `name` in `namespace`, as text (what `str(uuid.uuid5(...))` gives)."""
    return _as_uuid(hashlib.sha1(namespace + name.encode()).hexdigest(), "5")


def _as_uuid(digits: str, version: str) -> str:
    variant = "89ab"[int(digits[16], 16) & 3]
    return (
        f"{digits[:8]}-{digits[8:12]}-{version}{digits[13:16]}-{variant}{digits[17:20]}-"
        f"{digits[20:32]}"
    )


def _forget_random_after_fork() -> None:
    global _random, _used
    _random, _used = b"", 0


os.register_at_fork(after_in_child=_forget_random_after_fork)


@dataclass(slots=True)
class Envelope:
    """A message on the wire: string headers and an encoded body."""

    headers: dict[str, str]
    body: bytes

    @property
    def message_id(self) -> str | None:
        """The message's id, if it has one."""
        return self.headers.get(Header.MESSAGE_ID)

    @property
    def type_name(self) -> str | None:
        """The message's wire type name, if it has one."""
        return self.headers.get(Header.TYPE)

    @property
    def partition_key(self) -> str | None:
        """Messages sharing this key are handled one at a time, in order."""
        return self.headers.get(Header.PARTITION_KEY)

    def copy(self, **headers: str) -> Envelope:
        """A new envelope with the same body and these headers added or replaced."""
        merged = dict(self.headers)
        merged.update(headers)
        return Envelope(merged, self.body)


MAX_TYPE_NAME_BYTES = 255
"""A type name is a topic (a routing key) when published: an AMQP short string."""


def message(name: str) -> Callable[[T], T]:
    """Give a message class its wire type name, e.g. `@message("orders.PlaceOrder.v1")`."""
    check_type_name(name)

    def mark(cls: T) -> T:
        setattr(cls, NAME_ATTRIBUTE, name)
        return cls

    return mark


def check_type_name(name: object) -> str:
    """`name` if it can be a message type name; a `ConfigurationError` saying why not."""
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise ConfigurationError(f"message type name {name!r} must be non-empty without spaces")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ConfigurationError(f"message type name {name!r} is not valid Unicode") from None
    if size > MAX_TYPE_NAME_BYTES:
        raise ConfigurationError(
            f"message type name {name[:60]!r}... is {size} bytes long: a type name is a topic on "
            f"the broker and must fit in {MAX_TYPE_NAME_BYTES} bytes; give the class a shorter "
            'one with @message("...")'
        )
    return name


def check_message_class(cls: object, codec: object, use: str, *, bases: bool = True) -> None:
    """Refuse (`ConfigurationError`) a class the codec cannot carry, unless a base of one.

    A handler or a route for a base class covers its subclasses: with `bases`, a class of the
    program (not a builtin) passes when one of its subclasses is a message class. `use` is the
    App method taking it ("register", "route", "subscribe"). A codec without `accepts` (see
    `mersal.serialization.Codec`) is trusted with any class.
    """
    if not isinstance(cls, type):
        raise ConfigurationError(
            f"app.{use}() takes a message class, not {cls!r:.80}: pass the class itself"
        )
    accepts: Callable[[type], bool] | None = getattr(codec, "accepts", None)
    if accepts is None or accepts(cls):
        return
    builtin = cls.__module__ == "builtins"
    if bases and not builtin and any(accepts(sub) for sub in subclasses(cls)):
        return
    name = cls.__qualname__
    fix = (
        f"wrap the value in one (e.g. a @dataclass with a field of type {name})"
        if builtin
        else f"make {name} one (e.g. decorate it with @dataclass)"
    )
    raise ConfigurationError(
        f"app.{use}({name}{'' if use == 'subscribe' else ', ...'}): {name} is not a message "
        f"class; a message is {getattr(codec, 'supported', 'a class the codec carries')}: {fix}"
    )


def check_sendable(message: object, codec: object) -> None:
    """Refuse (`EncodeError`) an object that is not a message the codec carries (a dict, a class).

    A codec without `accepts` (see `mersal.serialization.Codec`) is trusted with any object.
    """
    accepts: Callable[[type], bool] | None = getattr(codec, "accepts", None)
    cls = type(message)
    if accepts is None or accepts(cls):
        return
    supported = getattr(codec, "supported", "a class the codec carries")
    if isinstance(message, type) and accepts(message):
        name = message.__qualname__
        raise EncodeError(f"cannot send the class {name} itself: send an instance, {name}(...)")
    if cls.__module__ == "builtins":
        raise EncodeError(
            f"cannot send {a_type(cls)}: a message is {supported}; define one "
            "(@dataclass class ...) and send an instance"
        )
    name = cls.__qualname__
    raise EncodeError(
        f"cannot send {name}: a message is {supported}; make {name} one (e.g. decorate it "
        "with @dataclass)"
    )


def type_name_of(cls: type) -> str:
    """The wire name of a message class: its `@message` name or `module.QualName`."""
    declared = cls.__dict__.get(NAME_ATTRIBUTE)
    if declared is not None:
        return str(declared)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class TypeRegistry:
    """An allow-list of message classes by wire name; a name never causes an import."""

    _by_name: dict[str, type] = field(default_factory=dict)
    _by_type: dict[type, str] = field(default_factory=dict)

    def add(self, cls: type) -> str:
        """Allow `cls`, returning its wire name; a name already taken by another class fails."""
        if not isinstance(cls, type):
            raise ConfigurationError(f"{cls!r} is not a class: register message classes")
        known = self._by_type.get(cls)
        if known is not None:
            return known
        name = check_type_name(type_name_of(cls))
        other = self._by_name.get(name)
        if other is not None and other is not cls:
            raise ConfigurationError(
                f"message type name {name!r} is used by both {_path(other)} and {_path(cls)}: "
                f'give one of them another name with @message("...")'
            )
        self._by_name[name] = cls
        self._by_type[cls] = name
        return name

    def name_of(self, cls: type) -> str:
        """The wire name of `cls`, allowing it on first use (a sender knows its classes)."""
        name = self._by_type.get(cls)
        return name if name is not None else self.add(cls)

    def resolve(self, name: str) -> type:
        """The registered class for a wire name, or a `DecodeError` if none is allowed."""
        cls = self._by_name.get(name)
        if cls is None:
            cls = self._find_subclass(name)
        if cls is None:
            shown = name if len(name) <= 200 else f"{name[:200]}...({len(name)} characters)"
            raise DecodeError(f"unknown message type {shown!r}: no registered class has that name")
        return cls

    def known(self, name: str) -> type | None:
        """The class registered under a wire name, or None (registers nothing, unlike resolve)."""
        return self._by_name.get(name)

    def _find_subclass(self, name: str) -> type | None:
        # A handler for a base class also covers subclasses already imported by the program.
        for base in list(self._by_type):
            if base is object:
                continue
            for sub in subclasses(base):
                if sub not in self._by_type and type_name_of(sub) == name:
                    try:
                        self.add(sub)
                    except ConfigurationError:  # its name is taken, or unusable
                        return None
                    return sub
        return None

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_type


def subclasses(cls: type) -> list[type]:
    """Every subclass of `cls`, their subclasses too, as defined by now."""
    found: list[type] = []
    pending: list[type] = list(cls.__subclasses__())
    while pending:
        sub = pending.pop()
        found.append(sub)
        pending.extend(sub.__subclasses__())
    return found


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


SHOWN_LENGTH = 100
"""The most characters of one header value that a log line shows."""


def describe(headers: dict[str, Any]) -> str:
    """A short log-friendly identity of a message: id, type, correlation id, attempt."""
    return (
        f"id={shown(headers.get(Header.MESSAGE_ID))} type={shown(headers.get(Header.TYPE))} "
        f"correlation={shown(headers.get(Header.CORRELATION_ID))}"
    )


_ESCAPES = {" ": "\\x20", "\\": "\\\\"}
"""How `shown` writes the printable characters it escapes."""


def shown(value: object) -> str:
    """A header value as a log line may show it: printable, one word, at most SHOWN_LENGTH long.

    Spaces, backslashes and what is not printable are escaped (a space as `\\x20`), so that a
    value cannot pass for another field of the line; a longer value is cut and ends in `...`.
    """
    text = str(value)
    if len(text) <= SHOWN_LENGTH and text.isprintable() and " " not in text and "\\" not in text:
        return text
    pieces: list[str] = []
    size = 0
    for c in text[: SHOWN_LENGTH + 1]:
        piece = _ESCAPES.get(c) or (c if c.isprintable() else repr(c)[1:-1])
        pieces.append(piece)
        size += len(piece)
    if size <= SHOWN_LENGTH and len(text) <= SHOWN_LENGTH:
        return "".join(pieces)
    while size > SHOWN_LENGTH - 3:
        size -= len(pieces.pop())
    return "".join(pieces) + "..."
