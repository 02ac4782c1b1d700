"""Sagas: long-running processes whose data lives between the messages that concern them.

A saga class names the messages that start it (`started_by`), how each message finds its saga
(`correlation`: an attribute or a function of the message), and one `async def` method per
message type, found by the type annotation of its parameter. Each message loads the saga's
data in the message's transaction, runs the method, and saves the data (or deletes it once the
saga is complete) in the same transaction as the handler's other writes, its outbox rows and
its inbox row. Two messages that change one saga at once conflict: the loser runs again at
once, without spending its retry budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import hashlib
import inspect
import itertools
import logging
import sys
import types
import typing
import uuid
import weakref
from collections.abc import (
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
    Set,
)
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

from mersal.context import MessageContext, current_message
from mersal.errors import ConcurrencyConflict, ConfigurationError, DecodeError, MersalError
from mersal.handlers import Handlers
from mersal.messages import (
    KEY_LENGTH,
    Header,
    check_message_class,
    describe,
    stored_key,
    subclasses,
)
from mersal.serialization import MAX_DEPTH, Codec, explain
from mersal.transaction import Transaction, current_transaction

log = logging.getLogger("mersal.sagas")

D = TypeVar("D")
Data = TypeVar("Data", covariant=True)
"""A saga's data type: covariant, so `type[Saga[X]]` is a `type[Saga[X | None]]`."""

MEMORY_CHANGES = "mersal.memory_sagas"
"""The key of a message's pending memory-store changes in `MessageContext.items`."""

CORRELATION_LENGTH = KEY_LENGTH
"""Correlation values up to this many characters are stored as they are; longer ones hashed."""

SAGA_NAME_LENGTH = 200
"""The longest saga name a saga store must hold."""

SAGA_ID_LENGTH = 36
"""A saga id is a UUID as text; a timeout naming a longer one names no saga."""

STORE_DECLARED = "store values of the fields' declared types"
"""What to do about saga data whose encoding does not decode back as its class."""

Correlation = str | Callable[[Any], object]
"""How a message finds its saga: the name of one of its attributes, or a function of it."""


class InvalidCorrelation(DecodeError):
    """A message's correlation value is missing or empty: no saga can be found for it."""


class UnrequestedTimeout(DecodeError):
    """A message of a saga's timeout type names the saga without a valid `saga-check`.

    The type reaches a saga only as a timeout the saga requested: no saga can take it.
    """


class Saga(Generic[Data]):
    """A long-running process: subclass it as `class Fulfilment(Saga[OrderData])`.

    The class is built per message like a handler class (lagom resolves its constructor), then
    given `data` (the saga's state, an instance of Data) and `saga_id` before its method runs.
    """

    started_by: ClassVar[tuple[type, ...]] = ()
    """The message types that create the saga when none is found for their correlation value."""
    correlation: ClassVar[Mapping[type, Correlation]] = {}
    """Per message type: the attribute name, or function, giving the saga's correlation value."""
    saga_name: ClassVar[str]
    """The saga type's stored name (`name=` in the class statement; default module.QualName)."""

    data: Data
    saga_id: str
    _completed: bool = False
    _correlation: str = ""

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.saga_name = name or f"{cls.__module__}.{cls.__qualname__}"

    def new_data(self, message: Any) -> Data:
        """The data of a saga a start message creates: by default, Data made without arguments."""
        data_type: type[Data] = data_type_of(type(self))
        try:
            return data_type()
        except TypeError as error:
            raise ConfigurationError(
                f"{type(self).__qualname__} cannot make a new {data_type.__qualname__} without "
                f"arguments ({error}): give every field a default, or override "
                "`def new_data(self, message)`"
            ) from None

    def mark_complete(self) -> None:
        """End the saga: its data goes when the message commits; later timeouts are ignored."""
        self._completed = True

    @property
    def completed(self) -> bool:
        """Whether `mark_complete()` was called while handling this message."""
        return self._completed

    async def request_timeout(
        self,
        delay: float | timedelta,
        message: object,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Have `message` delivered to this saga after `delay` (sent with the message's commit).

        The timeout comes back to this saga instance by its id; a type with a correlation here
        must carry this saga's correlation value (checked now). A timeout of a type without a
        correlation is ignored if the saga has completed by then. Returns the message's id.
        """
        context = current_message.get()
        spec: SagaSpec | None = getattr(self, "_spec", None)
        if context is None or spec is None or not self.saga_id:
            raise MersalError(
                "request_timeout() works only inside a saga's method, for the saga it handles "
                "(not in not_found, where there is no saga)"
            )
        if spec.method_for(type(message)) is None:
            name = type(message).__qualname__
            raise ConfigurationError(
                f"{spec.cls.__qualname__} has no method for {name}, so its timeout would reach "
                f"nobody: add `async def ...(self, timeout: {name})` to the saga"
            )
        _check_timeout_correlation(spec, message, self._correlation)
        marked = {
            **(headers or {}),
            Header.SAGA_ID: self.saga_id,
            Header.SAGA_TYPE: spec.name,
            Header.SAGA_CHECK: saga_check(spec.name, self.saga_id),
        }
        sent: str = await context.app.defer(delay, message, headers=marked, to_self=True)
        return sent

    async def not_found(self, message: Any) -> None:
        """Called for a message whose saga does not exist and which does not start one.

        By default the message is acknowledged and logged; override to raise (the message is
        then retried and dead-lettered) or to answer the sender.
        """
        log.info(
            "no %s saga for %s: ignored",
            type(self).__qualname__,
            type(message).__qualname__,
        )


def saga_check(saga: str, saga_id: str) -> str:
    """The `saga-check` header of a timeout that saga `saga_id` of type `saga` requests.

    A digest of the two, so that saga headers made up or copied by hand (a new id, another
    type) are told from a timeout the app requested. Not a secret: it stops mistakes, not a
    producer who means to forge.
    """
    text = f"{saga}\x00{saga_id}".encode(errors="surrogatepass")
    return hashlib.sha256(b"mersal-saga-timeout\x00" + text).hexdigest()[:32]


def requested_timeout(headers: Mapping[str, str], saga: str) -> str | None:
    """The saga id of a timeout that saga type `saga` requested, by the message's headers.

    None unless they name `saga` and an id, with the `saga-check` of the two.
    """
    saga_id = headers.get(Header.SAGA_ID)
    if headers.get(Header.SAGA_TYPE) != saga or saga_id is None:
        return None
    check = headers.get(Header.SAGA_CHECK)
    return saga_id if check == saga_check(saga, saga_id) else None


def shown(text: str, limit: int = SAGA_ID_LENGTH) -> str:
    """Header text for a log line or an error: quoted, printable, at most `limit` characters."""
    printable = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return repr(printable + ("..." if len(text) > limit else ""))


def _plausible_id(saga_id: str) -> bool:
    """Whether a header's saga id could name a saga (a longer one, or one with NUL, cannot)."""
    return 0 < len(saga_id) <= SAGA_ID_LENGTH and "\x00" not in saga_id


def data_type_of(cls: type) -> type:
    """The D of a `Saga[D]` subclass; a ConfigurationError if it declares none."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Saga:
                (argument,) = typing.get_args(base)
                if isinstance(argument, type):
                    return argument
    raise ConfigurationError(
        f"{cls.__qualname__} does not say what its data is: declare it as "
        f"`class {cls.__name__}(Saga[YourData])`, YourData a dataclass, pydantic model or "
        "msgspec Struct"
    )


@dataclass(slots=True)
class StoredSaga:
    """One saga's row: its id, correlation value, revision (0: not stored yet) and data."""

    id: str
    correlation: str
    revision: int = 0
    data: bytes | None = None


class SagaStore(Protocol):
    """Where sagas' data lives: loaded and saved in the transaction of the message at hand.

    `insert`, `update` and `delete` raise `ConcurrencyConflict` when another message created,
    changed or deleted the saga since it was loaded (at once, or when the message commits).
    """

    async def find(
        self,
        context: MessageContext,
        saga: str,
        *,
        correlation: str | None = None,
        saga_id: str | None = None,
        lock: bool = False,
    ) -> StoredSaga | None:
        """The saga of type `saga` with the correlation value or id; `lock`: FOR UPDATE."""
        ...

    async def insert(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Create the saga (revision 1)."""
        ...

    async def update(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Save new data over the revision `stored` was loaded at; the revision goes up by one."""
        ...

    async def delete(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Delete the saga, if it is still at the revision `stored` was loaded at."""
        ...

    async def read(
        self, saga: str, correlation: str, *, transaction: Transaction | None = None
    ) -> StoredSaga | None:
        """The saga as last committed; with `transaction` (open), as that transaction sees it."""
        ...


def _value(correlate: Callable[[Any], object], message: object, saga: SagaSpec) -> object:
    """The message's correlation value; a correlation that raises makes the message invalid."""
    try:
        return correlate(message)
    except Exception as error:
        raise InvalidCorrelation(
            f"the correlation of {type(message).__qualname__} for saga {saga.cls.__qualname__} "
            f"raised {type(error).__name__}: {error}"
        ) from error


def correlation_key(value: object, saga: SagaSpec, message_type: type) -> str:
    """The stored form of a correlation value: its text, or a digest past 255 characters."""
    text = "" if value is None else value.hex() if isinstance(value, bytes) else str(value)
    if not text:
        raise InvalidCorrelation(
            f"the correlation value of {message_type.__qualname__} for saga "
            f"{saga.cls.__qualname__} is {value!r}: no saga can be found by it"
        )
    return stored_key(text)


def _check_timeout_correlation(spec: SagaSpec, message: object, correlation: str) -> None:
    """A MersalError unless a timeout of a correlated type names this saga by its correlation.

    A timeout is found by its correlation value like any message of its type: a missing value
    would dead-letter it when it comes back, and another saga's value would not reach this one.
    """
    message_type = type(message)
    correlate = spec.correlate(message_type)
    if correlate is None:
        return
    where = f"{message_type.__qualname__}'s {describe_correlation(correlate)}"
    try:
        key = correlation_key(_value(correlate, message, spec), spec, message_type)
    except InvalidCorrelation as error:
        raise MersalError(
            f"request_timeout({message_type.__qualname__}) in {spec.cls.__qualname__}: {error}; "
            f"set {where} to this saga's correlation value, or use a timeout type that has no "
            "correlation"
        ) from None
    if key != correlation:
        raise MersalError(
            f"request_timeout({message_type.__qualname__}) in {spec.cls.__qualname__}: {where} "
            f"names another saga than this one ({key[:80]!r}, this saga's is "
            f"{correlation[:80]!r}), which the timeout would reach instead: set it to this "
            "saga's correlation value, or use a timeout type that has no correlation"
        )


def describe_correlation(correlate: Callable[[Any], object]) -> str:
    """How a correlation finds its saga, in words: `attribute 'order_id'` or `function f`."""
    if isinstance(correlate, _Attribute):
        return f"attribute {correlate.name!r}"
    return f"correlation function {getattr(correlate, '__qualname__', correlate)!r}"


@dataclass(frozen=True)
class _Attribute:
    """A correlation by attribute: the message's attribute `name` (None when it has none)."""

    name: str

    def __call__(self, message: object) -> object:
        return getattr(message, self.name, None)


@dataclass(frozen=True)
class SagaSpec:
    """A registered saga class: what starts it, how messages find it, which method takes each."""

    cls: type[Saga[Any]]
    name: str
    data_type: type
    started_by: tuple[type, ...]
    correlation: Mapping[type, Callable[[Any], object]]
    methods: Mapping[type, str]
    pessimistic: bool

    def method_for(self, message_type: type) -> str | None:
        """The method taking `message_type` (or its nearest base)."""
        return _nearest(self.methods, message_type)

    def correlate(self, message_type: type) -> Callable[[Any], object] | None:
        """How `message_type` (or its nearest base) finds its saga; None: only by saga id."""
        return _nearest(self.correlation, message_type)

    def starts(self, message_type: type) -> bool:
        """Whether a message of `message_type` creates the saga when none is found."""
        return any(issubclass(message_type, started) for started in self.started_by)

    @property
    def timeouts(self) -> list[type]:
        """The message types found only by saga id: the saga's timeouts."""
        return [t for t in self.methods if t not in self.correlation]


T = TypeVar("T")


def _nearest(table: Mapping[type, T], message_type: type) -> T | None:
    for cls in message_type.__mro__:
        found = table.get(cls)
        if found is not None:
            return found
    return None


def saga_spec(cls: object, codec: Codec, *, pessimistic: bool = False) -> SagaSpec:
    """Read and check a saga class; a ConfigurationError says what to change."""
    if not (isinstance(cls, type) and issubclass(cls, Saga)):
        raise ConfigurationError(
            f"register_saga() takes a subclass of mersal.sagas.Saga, not {cls!r:.80}"
        )
    name = cls.__qualname__
    data_type = data_type_of(cls)
    accepts: Callable[[type], bool] | None = getattr(codec, "accepts", None)
    if accepts is not None and not accepts(data_type):
        raise ConfigurationError(
            f"{name}'s data {data_type.__qualname__} cannot be stored: make it a dataclass, a "
            "pydantic model or a msgspec Struct"
        )
    methods = dict(_methods(cls))
    _refuse_sync_methods(cls, {*_mapping(cls), *_started_by(cls)} - methods.keys())
    if not methods:
        raise ConfigurationError(
            f"{name} handles nothing: add `async def placed(self, event: OrderPlaced)`-style "
            "methods, one per message type"
        )
    correlation = {t: _correlator(cls, t, how) for t, how in _mapping(cls).items()}
    for message_type, correlate in correlation.items():
        if message_type not in methods:
            raise ConfigurationError(
                f"{name}.correlation names {message_type.__qualname__}, which no method of "
                f"{name} takes: add `async def ...(self, message: {message_type.__qualname__})`"
            )
        _check_correlation(cls, message_type, correlate)
    started_by = tuple(_started_by(cls))
    if not started_by:
        raise ConfigurationError(
            f"{name} has no start message: set `started_by = (SomeMessage,)`, the types that "
            "create a saga when none is found"
        )
    for started in started_by:
        if started not in correlation:
            raise ConfigurationError(
                f"{name} is started by {started.__qualname__}, which needs a correlation: add "
                f"`{started.__qualname__}: 'attribute'` to {name}.correlation"
            )
    if len(cls.saga_name) > SAGA_NAME_LENGTH:
        raise ConfigurationError(
            f"{name}'s saga name is {len(cls.saga_name)} characters long, over the "
            f"{SAGA_NAME_LENGTH} the saga table holds: give it a shorter one "
            f"(`class {cls.__name__}(Saga[...], name='...')`)"
        )
    _check_new_data(cls, data_type, started_by)
    if not isinstance(pessimistic, bool):
        raise ConfigurationError(f"register_saga(pessimistic={pessimistic!r}) takes True or False")
    return SagaSpec(cls, cls.saga_name, data_type, started_by, correlation, methods, pessimistic)


def check_subscriptions(specs: Iterable[SagaSpec], subscriptions: Iterable[type]) -> None:
    """Refuse a subscribed event type that a saga takes without a correlation.

    Such a type reaches the saga only as its timeout, found by the saga id in its headers: a
    published event of it would never find its saga. (A route to the app's own queue is left
    alone: what the app sends itself may carry a saga's headers.)
    """
    subscribed = list(subscriptions)
    for spec in specs:
        for message_type in subscribed:
            method = spec.method_for(message_type)
            if method is not None and spec.correlate(message_type) is None:
                raise ConfigurationError(_uncorrelated_subscription(spec, message_type, method))


def _uncorrelated_subscription(spec: SagaSpec, message_type: type, method: str) -> str:
    saga, name = spec.cls.__qualname__, message_type.__qualname__
    attributes = [c.name for c in spec.correlation.values() if isinstance(c, _Attribute)]
    known = [a for a in attributes if _has_attribute(message_type, a)]
    attribute = known[0] if known else "attribute"
    return (
        f"{saga} takes {name} (method {method}) but has no correlation for it, and the app "
        f"subscribes to {name}: a published {name} would never find its saga. Add "
        f"`{name}: {attribute!r}` to {saga}.correlation (or, if {name} is only this saga's "
        "timeout, do not subscribe to it; if the app subscribes to it for another handler, "
        "give the timeout a type of its own)"
    )


def _methods(cls: type) -> Iterator[tuple[type, str]]:
    """Each message type a public `async def` method of the saga takes, with the method's name."""
    seen: dict[type, str] = {}
    for attribute in dir(cls):
        if attribute.startswith("_") or hasattr(Saga, attribute):
            continue
        method = getattr(cls, attribute)
        if not inspect.iscoroutinefunction(method):
            continue
        for message_type in _taken_types(cls, attribute, method):
            if message_type in seen:
                raise ConfigurationError(
                    f"{cls.__qualname__}.{seen[message_type]} and .{attribute} both take "
                    f"{message_type.__qualname__}: one method per message type"
                )
            seen[message_type] = attribute
            yield message_type, attribute


def _refuse_sync_methods(cls: type, known: set[type]) -> None:
    """Refuse a plain `def` method taking just a message the saga correlates or starts by, when
    no `async def` method takes it (a plain helper beside that method is left alone)."""
    for attribute in dir(cls):
        if attribute.startswith("_") or hasattr(Saga, attribute):
            continue
        method = getattr(cls, attribute)
        if not inspect.isfunction(method) or inspect.iscoroutinefunction(method):
            continue
        if len(inspect.signature(method).parameters) != 2:  # self and a message
            continue
        try:
            hints = typing.get_type_hints(method)
        except Exception:
            continue  # a helper whose hints do not resolve: not a message method
        taken = [hint for name, hint in hints.items() if name != "return" and hint in known]
        if taken:
            raise ConfigurationError(
                f"{cls.__qualname__}.{attribute} takes {taken[0].__qualname__} but is not async, "
                f"so it would never run: write `async def {attribute}(self, message: "
                f"{taken[0].__qualname__})`"
            )


def _taken_types(cls: type, attribute: str, method: Any) -> list[type]:
    parameters = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
    where = f"{cls.__qualname__}.{attribute}"
    if len(parameters) != 1:
        raise ConfigurationError(
            f"{where} must take exactly one message, `async def {attribute}(self, message: "
            "SomeMessage)`; make helpers private (`_name`)"
        )
    try:
        hint = typing.get_type_hints(method).get(parameters[0].name)
    except Exception as error:
        raise ConfigurationError(
            f"cannot read the type hints of {where} ({error}): import the annotated types at "
            "module level"
        ) from None
    candidates = typing.get_args(hint) if _is_union(hint) else (hint,)
    taken = [t for t in candidates if isinstance(t, type)]
    if not taken or len(taken) != len(candidates):
        raise ConfigurationError(
            f"{where}'s parameter needs the message class as its annotation, e.g. "
            f"`(self, message: SomeMessage)`, not {hint!r}"
        )
    return taken


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _mapping(cls: type[Saga[Any]]) -> Mapping[type, Correlation]:
    mapping = cls.correlation
    if not isinstance(mapping, Mapping) or not all(isinstance(t, type) for t in mapping):
        raise ConfigurationError(
            f"{cls.__qualname__}.correlation must map message classes to an attribute name or "
            "a function, e.g. `{OrderPlaced: 'order_id'}`"
        )
    return mapping


def _started_by(cls: type[Saga[Any]]) -> Iterator[type]:
    started = cls.started_by
    if isinstance(started, type):
        started = (started,)
    for message_type in started:
        if not isinstance(message_type, type):
            raise ConfigurationError(
                f"{cls.__qualname__}.started_by must list message classes, not {message_type!r}"
            )
        yield message_type


def _correlator(cls: type, message_type: type, how: object) -> Callable[[Any], object]:
    if isinstance(how, str) and how:
        return _Attribute(how)
    if callable(how):
        return how
    raise ConfigurationError(
        f"{cls.__qualname__}.correlation[{message_type.__qualname__}] must be an attribute name "
        f"or a function of the message, not {how!r}"
    )


def _check_correlation(cls: type, message_type: type, correlate: Callable[[Any], object]) -> None:
    """Refuse a correlation that cannot read the message: an attribute it does not have (when
    its class's fields are known), or a function that does not take the message alone."""
    where = f"{cls.__qualname__}.correlation[{message_type.__qualname__}]"
    if isinstance(correlate, _Attribute):
        _check_attribute(where, message_type, correlate.name)
        return
    try:
        signature = inspect.signature(correlate)
    except (TypeError, ValueError):  # a builtin or a class: nothing to read
        return
    try:
        signature.bind(None)
    except TypeError as error:
        raise ConfigurationError(
            f"{where} is {describe_correlation(correlate)}, which cannot be called with the "
            f"message alone ({error}): give a function of one argument, e.g. "
            "`lambda message: message.order_id`"
        ) from None


def _check_attribute(where: str, message_type: type, attribute: str) -> None:
    """Refuse an attribute that neither the message class nor a subclass of it has, or a method."""
    if isinstance(inspect.getattr_static(message_type, attribute, None), types.FunctionType):
        raise ConfigurationError(
            f"{where} is {attribute!r}, a method of {message_type.__qualname__}: the correlation "
            "would be the method itself, not what it returns, and would find no saga. Make it a "
            f"@property, or give a function of the message, `lambda message: "
            f"message.{attribute}()`"
        )
    if not _knows_attributes(message_type) or any(
        _has_attribute(t, attribute) for t in (message_type, *subclasses(message_type))
    ):
        return
    name = message_type.__qualname__
    fields = _fields(message_type)
    names = [f.attribute for f in fields]
    stored_as = [f.attribute for f in fields if attribute in f.keys]
    missing = f"{where} is {attribute!r}, but {name} has no attribute {attribute!r}"
    if not names:
        raise ConfigurationError(f"{missing}, nor any field: give a function of the message")
    if stored_as:
        raise ConfigurationError(
            f"{missing} ({attribute!r} is how its field {stored_as[0]!r} is stored; the "
            f"correlation reads the attribute): name {stored_as[0]!r}, or give a function of "
            "the message"
        )
    close = difflib.get_close_matches(attribute, names, n=1)
    hint = f": did you mean {close[0]!r}? Name" if close else ": name"
    listed = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    raise ConfigurationError(
        f"{missing}{hint} one of its fields ({listed}), or give a function of the message"
    )


def _knows_attributes(cls: type) -> bool:
    """Whether every attribute of `cls`'s messages is known from the class (fields and all).

    Not so for a plain class, one whose `__getattr__` may answer any name (pydantic's own
    serves only private attributes and, with `extra="allow"`, unknown fields), or one whose
    post-init hook may set attributes of its own.
    """
    if not _is_data_class(cls) or _keeps_extras(cls):
        return False
    if hasattr(cls, "__post_init__") or hasattr(cls, "__attrs_post_init__"):
        return False
    return not any(
        "__getattr__" in klass.__dict__ and not klass.__module__.startswith("pydantic")
        for klass in cls.__mro__
    )


def _has_attribute(cls: type, attribute: str) -> bool:
    """Whether `cls`'s instances have `attribute`: a field, or one of the class (a property)."""
    return hasattr(cls, attribute) or any(f.attribute == attribute for f in _fields(cls))


def _check_new_data(cls: type, data_type: type, started_by: tuple[type, ...]) -> None:
    """Refuse a saga whose first start message would fail to make its data."""
    name = cls.__qualname__
    made = inspect.getattr_static(cls, "new_data")
    function = made.__func__ if isinstance(made, staticmethod | classmethod) else made
    if inspect.iscoroutinefunction(function):
        raise ConfigurationError(
            f"{name}.new_data is `async def`, but it is called without await: make it a plain "
            f"`def new_data(self, message)` that returns the {data_type.__qualname__}"
        )
    if inspect.isfunction(made) and made is not Saga.new_data:
        try:
            inspect.signature(made).bind(None, None)
        except TypeError as error:
            raise ConfigurationError(
                f"{name}.new_data cannot take the start message ({error}): declare it "
                f"`def new_data(self, message)`"
            ) from None
    if made is not Saga.new_data:
        return
    required = _required_fields(data_type)
    if required:
        one = len(required) == 1
        raise ConfigurationError(
            f"{name} does not override new_data, and its data {data_type.__qualname__} cannot "
            f"be made without arguments: {', '.join(required)} {'has' if one else 'have'} no "
            "default, so every start message would be dead-lettered. Give "
            f"{'it a default' if one else 'them defaults'}, or make the data from the start "
            f"message: {_new_data_sample(data_type, started_by, required)}"
        )


def _new_data_sample(data_type: type, started_by: tuple[type, ...], required: list[str]) -> str:
    """A `new_data` that fills the required fields, from the start message where it has them."""
    starts = " | ".join(t.__qualname__ for t in started_by)
    data = data_type.__qualname__
    arguments = ", ".join(
        f"{field}=message.{field}"
        if all(_has_attribute(t, field) for t in started_by)
        else f"{field}=..."
        for field in required
    )
    return f"`def new_data(self, message: {starts}) -> {data}: return {data}({arguments})`"


def _required_fields(data_type: type) -> list[str]:
    """The arguments `data_type()` cannot do without (as far as its kind of class tells)."""
    if issubclass(data_type, msgspec.Struct):
        return [f.name for f in msgspec.structs.fields(data_type) if f.required]
    model_fields: Mapping[str, Any] | None = getattr(data_type, "model_fields", None)
    if model_fields is not None:  # pydantic: its alias when it is built by that
        return [
            info.validation_alias if isinstance(info.validation_alias, str) else info.alias or name
            for name, info in model_fields.items()
            if info.is_required()
        ]
    if dataclasses.is_dataclass(data_type):  # its __init__: InitVars too, or one of its own
        return [
            p.name
            for p in inspect.signature(data_type).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    attributes = getattr(data_type, "__attrs_attrs__", ())
    nothing = getattr(sys.modules.get("attr"), "NOTHING", None)
    return [
        getattr(a, "alias", None) or a.name
        for a in attributes
        if a.init and a.default is nothing and nothing is not None
    ]


class SagaRunner:
    """What runs for each message a saga takes: load, run the saga's method, save or delete."""

    def __init__(
        self,
        spec: SagaSpec,
        build: Callable[[MessageContext], object],
        store: Callable[[], SagaStore],
        codec: Codec,
        sagas: Mapping[str, SagaRunner] | None = None,
    ) -> None:
        self.spec = spec
        self.build = build
        self.store = store
        self.codec = codec
        self.sagas: Mapping[str, SagaRunner] = {} if sagas is None else sagas
        """The app's saga runners by saga name (this one's included): whose timeout is what."""

    async def __call__(self, message: Any, context: MessageContext) -> None:
        """Handle one message for the saga it correlates to (once, if several types match)."""
        spec, store = self.spec, self.store()
        ran = f"mersal.saga:{spec.name}"
        if ran in context.items:  # registered for a message's class and a base of it
            return
        context.items[ran] = True
        stored = await self._find(message, context)
        if stored is None:
            return
        saga = self._activate(context, stored)
        if stored.data is None:
            saga.data = saga.new_data(message)
        method = spec.method_for(type(message))
        assert method is not None
        await getattr(saga, method)(message)
        if saga.completed:
            if stored.revision:
                await store.delete(context, spec.name, stored)
            return
        saved = replace(stored, data=self._encode(saga.data, method, stored))
        if stored.revision:
            await store.update(context, spec.name, saved)
        else:
            await store.insert(context, spec.name, saved)

    async def _lookup(
        self, message: Any, context: MessageContext, timeout_id: str | None
    ) -> StoredSaga | None:
        """The saga the message's correlation value finds; a timeout type's, by `timeout_id`."""
        spec = self.spec
        store = self.store()
        lock = spec.pessimistic or context.conflicts > 0  # a rerun waits its turn, not races
        message_type = type(message)
        correlate = spec.correlate(message_type)
        if correlate is not None:
            key = correlation_key(_value(correlate, message, spec), spec, message_type)
            context.items[f"mersal.saga-key:{spec.name}"] = key
            return await store.find(context, spec.name, correlation=key, lock=lock)
        if timeout_id is not None and _plausible_id(timeout_id):
            return await store.find(context, spec.name, saga_id=timeout_id, lock=lock)
        return None

    async def _find(self, message: Any, context: MessageContext) -> StoredSaga | None:
        """The message's saga, a new one for a start message, or None (the message is done).

        A message whose saga headers name this saga type goes to the instance with its id when
        that exists (found by id for a type without a correlation here, by its correlation value
        for one with). When it does not, a valid `saga-check` makes it the timeout of a saga that
        has ended: ignored. Without one a correlated type is handled as what its type says (its
        saga, a new one, or `not_found`); a type without a correlation, which reaches a saga only
        as a timeout, is refused (`UnrequestedTimeout`). So timeouts requested before the check
        existed still reach the sagas that run.
        """
        spec, headers = self.spec, context.headers
        message_type = type(message)
        correlated = spec.correlate(message_type) is not None
        if self._for_another_saga(message, context):
            return None
        timeout_id = requested_timeout(headers, spec.name)
        if timeout_id is not None:
            found = await self._lookup(message, context, timeout_id)
            if found is not None and found.id == timeout_id:
                return found
            log.info(
                "%s: timeout of saga %s of %s, which has ended: ignored",
                describe(headers),
                shown(timeout_id),
                spec.cls.__qualname__,
            )
            return None
        if not correlated and headers.get(Header.SAGA_TYPE) == spec.name:
            saga_id = headers.get(Header.SAGA_ID, "")
            found = await self._lookup(message, context, saga_id)
            if found is not None:
                return found
            raise UnrequestedTimeout(
                f"{type(message).__qualname__} names saga {shown(saga_id)} of "
                f"{spec.cls.__qualname__}, which does not exist, without a valid saga-check: "
                "not a timeout this app requested"
            )
        found = await self._lookup(message, context, None)
        if found is not None:
            return found
        if correlated and spec.starts(message_type):
            return StoredSaga(str(uuid.uuid4()), context.items[f"mersal.saga-key:{spec.name}"])
        await self._activate(context, StoredSaga("", "")).not_found(message)
        return None

    def _for_another_saga(self, message: Any, context: MessageContext) -> bool:
        """Whether the message is a timeout another registered saga requested: this one leaves it.

        Only a valid `saga-check` for the saga the headers name, which takes the message's type,
        makes it that saga's; other saga headers are ignored here.
        """
        headers = context.headers
        target = headers.get(Header.SAGA_TYPE)
        if target is None or target == self.spec.name:
            return False
        other = self.sagas.get(target)
        if other is None or other.spec.method_for(type(message)) is None:
            log.debug(
                "%s names saga type %s, which does not take it in this app: saga headers ignored",
                describe(headers),
                shown(target, SAGA_NAME_LENGTH),
            )
            return False
        if requested_timeout(headers, target) is None:
            log.debug(
                "%s names saga type %s without a valid saga-check: not its timeout for %s",
                describe(headers),
                shown(target, SAGA_NAME_LENGTH),
                self.spec.cls.__qualname__,
            )
            return False
        log.debug(
            "%s is a timeout of saga %s: not for %s", describe(headers), target, self.spec.name
        )
        return True

    def _activate(self, context: MessageContext, stored: StoredSaga) -> Saga[Any]:
        saga = self.build(context)
        assert isinstance(saga, Saga)
        saga.saga_id = stored.id
        saga._completed = False
        saga._correlation = stored.correlation
        saga._spec = self.spec  # type: ignore[attr-defined]
        if stored.data is not None:
            saga.data = self._decode(stored)
        return saga

    def _decode(self, stored: StoredSaga) -> Any:
        assert stored.data is not None
        try:
            return decode_data(self.codec, stored.data, self.spec.data_type)
        except DecodeError as error:
            raise MersalError(
                f"the stored data of {self.spec.cls.__qualname__} saga {stored.id} does not "
                f"decode as {self.spec.data_type.__qualname__} ({error}): migrate the stored "
                "data, or make the class accept it (defaults for new fields)"
            ) from None

    def _encode(self, data: object, method: str, stored: StoredSaga) -> bytes:
        """The data to save: checked to load back as the data class, with what a newer release
        stored (values are not compared: a validator or an excluded field may change them)."""
        spec = self.spec
        name = f"{spec.cls.__qualname__}.{method}()"
        if not isinstance(data, spec.data_type):
            raise MersalError(
                f"{spec.cls.__qualname__}.data is a {type(data).__qualname__} after {name}, "
                f"not a {spec.data_type.__qualname__}: assign the saga's data class, or call "
                "mark_complete() to end the saga"
            )
        encoded = self.codec.encode(data)
        try:
            decode_data(self.codec, encoded, spec.data_type)
        except DecodeError as error:
            raise MersalError(
                f"{name} left data in saga {spec.name!r} that would not load back as "
                f"{spec.data_type.__qualname__}, so nothing was saved: "
                f"{explain(data, error, STORE_DECLARED)}"
            ) from None
        self._check_nothing_newer(stored)
        return keep_unknown(encoded, stored.data, spec.data_type)

    def _check_nothing_newer(self, stored: StoredSaga) -> None:
        """A MersalError if saving would erase what a newer release stored inside the data."""
        spec = self.spec
        newer = newer_nested_fields(stored.data, spec.data_type)
        if newer:
            shown = ", ".join(repr(path[:80]) for path in newer[:5])
            raise MersalError(
                f"the stored data of {spec.cls.__qualname__} saga {stored.id} holds {shown}, "
                f"which {spec.data_type.__qualname__} of this release does not know: a newer "
                "release wrote it, and saving would erase it. Run the newer release for this "
                "saga, or add the field to this release's class; nothing was saved"
            )


@dataclass(slots=True)
class _Change:
    key: tuple[str, str]
    stored: StoredSaga
    revision: int | None  # None: delete


class MemorySagaStore:
    """Sagas in this process's memory (an app without a database, and the test harness).

    A message's changes wait in its transaction. At commit they are checked against the
    revisions they were loaded at and applied all together, before the transaction's messages
    are sent; if sending fails they are undone. One message commits its sagas at a time.
    """

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], StoredSaga] = {}
        self.ids: dict[str, tuple[str, str]] = {}
        self._commits = asyncio.Lock()
        self._pending: dict[Transaction, list[_Change]] = {}

    async def find(
        self,
        context: MessageContext,
        saga: str,
        *,
        correlation: str | None = None,
        saga_id: str | None = None,
        lock: bool = False,
    ) -> StoredSaga | None:
        """The saga as last committed (`lock` changes nothing: commits check revisions)."""
        if saga_id is not None:
            key = self.ids.get(saga_id)
            if key is None or key[0] != saga:
                return None
        else:
            assert correlation is not None
            key = (saga, correlation)
        found = self.rows.get(key)
        return None if found is None else replace(found)

    async def insert(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Create the saga when the message commits (a conflict if one exists by then)."""
        self._changes(context).append(_Change((saga, stored.correlation), stored, 1))

    async def update(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Save the data when the message commits (a conflict if the saga changed meanwhile)."""
        change = _Change((saga, stored.correlation), stored, stored.revision + 1)
        self._changes(context).append(change)

    async def delete(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Delete the saga when the message commits (a conflict if it changed meanwhile)."""
        self._changes(context).append(_Change((saga, stored.correlation), stored, None))

    async def read(
        self, saga: str, correlation: str, *, transaction: Transaction | None = None
    ) -> StoredSaga | None:
        """The saga as last committed, with the pending changes of `transaction` if given."""
        key = (saga, correlation)
        found = self.rows.get(key)
        for change in self._pending.get(transaction, []) if transaction is not None else []:
            if change.key == key:
                found = self._after(change)
        return None if found is None else replace(found)

    def _changes(self, context: MessageContext) -> list[_Change]:
        """The message's pending changes; the first one hooks the commit of its transaction."""
        changes: list[_Change] | None = context.items.get(MEMORY_CHANGES)
        if changes is None:
            changes = context.items[MEMORY_CHANGES] = []
            self._pending[context.transaction] = changes
            self._hook(context.transaction, changes)
        return changes

    def _hook(self, transaction: Transaction, changes: list[_Change]) -> None:
        applied: list[tuple[tuple[str, str], StoredSaga | None, StoredSaga | None]] = []
        held = False

        async def apply() -> None:
            nonlocal held
            await self._commits.acquire()
            held = True
            for change in changes:
                self._check(change)
            for change in changes:
                applied.append((change.key, self.rows.get(change.key), self._apply(change)))

        def end(committed: bool) -> None:
            nonlocal held
            self._pending.pop(transaction, None)
            if not committed:
                for key, before, after in reversed(applied):
                    if self.rows.get(key) is after:
                        self._put(key, before, after)
            if held:
                held = False
                self._commits.release()

        transaction.before_commit(apply)
        transaction.when_ended(end)

    def _check(self, change: _Change) -> None:
        current, stored = self.rows.get(change.key), change.stored
        if (current.revision if current else 0) != stored.revision or (
            current is not None and current.id != stored.id
        ):
            raise ConcurrencyConflict(
                f"saga {change.key[0]} {stored.correlation!r} changed since it was loaded"
            )

    def _apply(self, change: _Change) -> StoredSaga | None:
        before = self.rows.get(change.key)
        after = self._after(change)
        self._put(change.key, after, before)
        return after

    @staticmethod
    def _after(change: _Change) -> StoredSaga | None:
        """The saga's row once `change` applies (None: deleted)."""
        return None if change.revision is None else replace(change.stored, revision=change.revision)

    def _put(
        self, key: tuple[str, str], row: StoredSaga | None, replaced: StoredSaga | None
    ) -> None:
        if replaced is not None:
            self.ids.pop(replaced.id, None)
            self.rows.pop(key, None)
        if row is not None:
            self.rows[key] = row
            self.ids[row.id] = key


class Sagas:
    """An app's sagas: their registrations, runners, and where their data lives."""

    def __init__(self, owner: object, name: str, codec: Codec, handlers: Handlers) -> None:
        self.owner = owner
        """The App whose transactions `data` reads within."""
        self.name = name
        self.codec = codec
        self.handlers = handlers
        self.specs: list[SagaSpec] = []
        self.runners: dict[str, SagaRunner] = {}
        self.memory = MemorySagaStore()
        self.storage: object | None = None
        """The app's storage once attached: its `sagas` store holds the data."""

    def register(self, saga: type[Saga[Any]], pessimistic: bool, subscriptions: list[type]) -> None:
        """Check the saga and have its runner handle each message type it takes."""
        spec = saga_spec(saga, self.codec, pessimistic=pessimistic)
        for other in self.specs:
            if other.name == spec.name:
                raise ConfigurationError(
                    f"{saga.__qualname__} and {other.cls.__qualname__} are both saga "
                    f"{spec.name!r}: give one another name (`class ...(Saga[D], name='...')`)"
                )
        for message_type in spec.methods:
            check_message_class(message_type, self.codec, "register_saga")
        check_subscriptions([spec], subscriptions)
        runner = SagaRunner(spec, self.handlers.builder(saga), self.store, self.codec, self.runners)
        self.runners[spec.name] = runner

        async def run(message: Any, context: MessageContext) -> None:
            await runner(message, context)

        run.__qualname__ = saga.__qualname__
        for message_type in spec.methods:
            self.handlers.add(message_type, run, builds=(saga,))
        self.specs.append(spec)

    @property
    def classes(self) -> list[type[Saga[Any]]]:
        """The saga classes registered, in order."""
        return [spec.cls for spec in self.specs]

    @property
    def timeouts(self) -> list[type]:
        """Every saga's timeout types (they come back to the app's own queue)."""
        return [t for spec in self.specs for t in spec.timeouts]

    def spec(self, saga: type[Saga[Any]]) -> SagaSpec:
        """The registration of a saga class; a ConfigurationError if it is not registered."""
        for spec in self.specs:
            if spec.cls is saga:
                return spec
        raise ConfigurationError(
            f"{getattr(saga, '__qualname__', saga)} is not a saga of app {self.name!r}: "
            "app.register_saga(...) it first"
        )

    def store(self) -> SagaStore:
        """Where the sagas live: the storage's saga table, or this process's memory."""
        if self.storage is None:
            return self.memory
        store: SagaStore | None = getattr(self.storage, "sagas", None)
        if store is None:
            raise ConfigurationError(
                f"the storage of app {self.name!r} ({type(self.storage).__qualname__}) keeps no "
                "sagas: use mersal_sqlalchemy's, or drop the register_saga calls"
            )
        return store

    async def data(self, saga: type[Saga[D]], correlation: object) -> D | None:
        """The committed data of the `saga` whose correlation value is `correlation`, or None.

        Inside a transaction of this app (a handler's, or an `app.transaction()` block's) it is
        read in that transaction (so it does not wait for a database connection the transaction
        holds): the data as the transaction sees it.
        """
        spec = self.spec(saga)
        key = correlation_key(correlation, spec, type(correlation))
        transaction = current_transaction.get()
        if transaction is not None and not (transaction.owner is self.owner and transaction.open):
            transaction = None
        stored = await self.store().read(spec.name, key, transaction=transaction)
        if stored is None or stored.data is None:
            return None
        decoded: D = decode_data(self.codec, stored.data, spec.data_type)
        return decoded


def decode_data(codec: Codec, data: bytes, data_type: type) -> Any:
    """Stored saga data as `data_type`.

    Top-level keys a newer release added are left to the class, which ignores them, or (a
    pydantic model with `extra="allow"`) keeps them; only for a class that forbids unknown
    fields are they left out, and so are its computed fields.
    """
    if _forbids_unknown(data_type):
        stored = _json_object(data)
        if stored is not None:
            known = _input_keys(data_type)
            if any(key not in known for key in stored):
                data = msgspec.json.encode({k: v for k, v in stored.items() if k in known})
    return codec.decode(data, data_type)


def keep_unknown(encoded: bytes, stored: bytes | None, data_type: type) -> bytes:
    """`encoded` with the stored data's top-level keys that `data_type` does not know.

    A newer release may have added a field: an older one that saves the saga keeps it. Only
    keys absent from `encoded` and unknown to the class come back (a known field that the
    encoding leaves out, at its default with `omit_defaults`, stays out). Only data a codec
    writes as a JSON object can keep them (the JSON codec's).
    """
    before = None if stored is None or _keeps_extras(data_type) else _json_object(stored)
    if not before:
        return encoded
    known = data_keys(data_type)
    unknown = {key: value for key, value in before.items() if key not in known}
    after = _json_object(encoded) if unknown else None
    if after is None:
        return encoded
    return msgspec.json.encode({**after, **{k: v for k, v in unknown.items() if k not in after}})


def newer_nested_fields(stored: bytes | None, data_type: type) -> list[str]:
    """Where the stored data holds what `data_type` cannot keep: paths such as `addr.zip`.

    A key inside a nested object that its class does not know (in a union, no class the object
    may be), or an element past the fields of an `array_like` Struct: a newer release wrote
    it, and saving this release's data would erase it. (Top-level keys: `keep_unknown`.)
    """
    if stored is None or stored[:1] not in (b"{", b"["):
        return []
    try:
        value = msgspec.json.decode(stored)
    except msgspec.DecodeError:
        return []
    return list(_newer_fields(value, data_type, "", MAX_DEPTH, top=True))


def _newer_fields(
    value: Any, hint: Any, path: str, depth: int, *, top: bool = False
) -> Iterator[str]:
    if depth <= 0:
        return
    hint = _single_class(hint)
    origin = typing.get_origin(hint) or hint
    arguments = typing.get_args(hint)
    if _is_union(hint):
        yield from _newer_in_union(value, arguments, path, depth)
    elif isinstance(value, dict) and origin in _MAPPINGS and len(arguments) == 2:
        for key, item in value.items():
            yield from _newer_fields(item, arguments[1], f"{path}[{key!r}]", depth - 1)
    elif isinstance(value, list) and origin in _SEQUENCES and arguments:
        fixed = origin is tuple and arguments[-1] is not Ellipsis  # tuple[A, B]: by position
        hints = arguments if fixed else itertools.repeat(arguments[0])
        for index, (item, item_hint) in enumerate(zip(value, hints, strict=False)):
            yield from _newer_fields(item, item_hint, f"{path}[{index}]", depth - 1)
    elif isinstance(hint, type) and _is_data_class(hint):
        yield from _newer_in_object(value, hint, path, depth, top)


def _newer_in_union(value: Any, members: tuple[Any, ...], path: str, depth: int) -> Iterator[str]:
    """What no member of a union that `value` may be knows (nothing if one knows it all).

    The members are those of the value's shape (an object, an array); of tagged Structs, the
    one the value's tag names.
    """
    candidates = [_single_class(member) for member in members]
    candidates = [member for member in candidates if _may_be(value, member)]
    tagged = [member for member in candidates if _tag_matches(value, member)]
    newer: list[list[str]] = []
    for member in tagged or candidates:
        found = list(_newer_fields(value, member, path, depth))
        if not found:
            return
        newer.append(found)
    if newer:
        yield from min(newer, key=len)


def _may_be(value: Any, hint: Any) -> bool:
    """Whether stored `value` has the shape of `hint` (a mapping or object; a sequence)."""
    origin = typing.get_origin(hint) or hint
    data_class = isinstance(hint, type) and _is_data_class(hint)
    if isinstance(value, dict):
        return origin in _MAPPINGS or (data_class and not _array_like(hint))
    if isinstance(value, list):
        return origin in _SEQUENCES or (data_class and _array_like(hint))
    return False


def _tag_matches(value: Any, hint: Any) -> bool:
    """Whether `value` carries the tag of `hint`, a tagged Struct."""
    if not (isinstance(hint, type) and issubclass(hint, msgspec.Struct)):
        return False
    config = hint.__struct_config__
    if config.tag is None:
        return False
    if isinstance(value, list):
        return bool(value) and value[0] == config.tag
    return isinstance(value, dict) and value.get(config.tag_field) == config.tag


def _newer_in_object(value: Any, cls: type, path: str, depth: int, top: bool) -> Iterator[str]:
    fields = _fields(cls)
    if isinstance(value, list) and _array_like(cls):
        positions = _tag_positions(cls)
        if len(value) > positions + len(fields):
            yield f"{path}[{positions + len(fields)}]"
        for index, (field, item) in enumerate(zip(fields, value[positions:], strict=False)):
            where = f"{path}[{positions + index}]"
            yield from _newer_fields(item, field.hint, where, depth - 1)
        return
    if not isinstance(value, dict):
        return
    if not top and not _keeps_extras(cls):
        known = data_keys(cls)
        yield from (f"{path}.{key}".lstrip(".") for key in value if key not in known)
    for field in fields:
        for key in dict.fromkeys(field.keys):
            if key in value:
                where = f"{path}.{key}".lstrip(".")
                yield from _newer_fields(value[key], field.hint, where, depth - 1)


_MAPPINGS: tuple[object, ...] = (dict, Mapping, MutableMapping)
_SEQUENCES: tuple[object, ...] = (list, tuple, set, frozenset, Sequence, MutableSequence, Set)


def _single_class(hint: Any) -> Any:
    """`X` for `X | None` (a union of one type and None) and `Annotated[X, ...]`; else `hint`."""
    if typing.get_origin(hint) is typing.Annotated:
        return _single_class(typing.get_args(hint)[0])
    if _is_union(hint):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def _is_data_class(cls: type) -> bool:
    return (
        dataclasses.is_dataclass(cls)
        or issubclass(cls, msgspec.Struct)
        or hasattr(cls, "__attrs_attrs__")
        or hasattr(cls, "model_fields")
    )


def _array_like(cls: type) -> bool:
    return issubclass(cls, msgspec.Struct) and bool(cls.__struct_config__.array_like)


def _tag_positions(cls: type) -> int:
    """How many elements an `array_like` Struct's array starts with before its fields (a tag)."""
    return 0 if cls.__struct_config__.tag is None else 1  # type: ignore[attr-defined]


class _Field(typing.NamedTuple):
    attribute: str
    keys: tuple[str, ...]
    """Every key the field may be stored under: its name, encode name, aliases."""
    hint: Any


def _fields(cls: type) -> tuple[_Field, ...]:
    """The fields of a data class: attribute, the keys it may be stored under, and type.

    Read once per class (every save of a saga checks them): a class whose annotations cannot
    be resolved yet is read again next time.
    """
    known = _known_fields.get(cls)
    if known is None:
        known, complete = _read_fields(cls)
        if complete:
            _known_fields[cls] = known
    return known


_known_fields: weakref.WeakKeyDictionary[type, tuple[_Field, ...]] = weakref.WeakKeyDictionary()


def _read_fields(cls: type) -> tuple[tuple[_Field, ...], bool]:
    """The fields of `cls`, and whether its type hints could all be resolved."""
    if issubclass(cls, msgspec.Struct):
        fields = msgspec.structs.fields(cls)
        return tuple(_Field(f.name, (f.name, f.encode_name), f.type) for f in fields), True
    model_fields: Mapping[str, Any] | None = getattr(cls, "model_fields", None)
    if model_fields is not None:  # pydantic
        return tuple(
            _Field(name, tuple(_aliases(name, info)), info.annotation)
            for name, info in model_fields.items()
        ), True
    complete = True
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a class whose annotations name what its module does not hold
        hints, complete = {}, False
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
    else:
        names = [a.name for a in getattr(cls, "__attrs_attrs__", ())]
    return tuple(_Field(name, (name,), hints.get(name, Any)) for name in names), complete


def data_keys(data_type: type) -> frozenset[str]:
    """The top-level keys a data class reads and writes: its fields' names and every alias."""
    return _input_keys(data_type) | set(_computed_keys(data_type))


def _input_keys(data_type: type) -> frozenset[str]:
    """The top-level keys a data class reads (its computed fields it only writes)."""
    keys = {key for field in _fields(data_type) for key in field.keys}
    if issubclass(data_type, msgspec.Struct):
        tag = data_type.__struct_config__.tag_field
        if tag is not None:
            keys.add(tag)
    return frozenset(keys)


def _computed_keys(data_type: type) -> Iterator[str]:
    """The keys of a pydantic model's computed fields: written, never read."""
    computed: Mapping[str, Any] = getattr(data_type, "model_computed_fields", None) or {}
    for name, info in computed.items():
        yield name
        if isinstance(info.alias, str):
            yield info.alias


def _aliases(name: str, info: Any) -> Iterator[str]:
    """A pydantic field's name and every key it may be read or written under."""
    yield name
    for alias in (info.alias, info.serialization_alias, info.validation_alias):
        choices = getattr(alias, "choices", None)  # AliasChoices
        for choice in [alias] if choices is None else choices:
            path = getattr(choice, "path", None)  # AliasPath: its first key is top-level
            if isinstance(choice, str):
                yield choice
            elif path and isinstance(path[0], str):
                yield path[0]


def _forbids_unknown(data_type: type) -> bool:
    """Whether decoding `data_type` refuses keys it does not know."""
    if issubclass(data_type, msgspec.Struct):
        return bool(data_type.__struct_config__.forbid_unknown_fields)
    return _pydantic_extra(data_type) == "forbid"


def _keeps_extras(data_type: type) -> bool:
    """Whether `data_type` keeps keys it does not know itself (pydantic's `extra="allow"`)."""
    return _pydantic_extra(data_type) == "allow"


def _pydantic_extra(data_type: type) -> object:
    config = getattr(data_type, "model_config", None)
    return config.get("extra") if isinstance(config, Mapping) else None


def _json_object(data: bytes) -> dict[str, Any] | None:
    """The JSON object `data` is, or None (a codec's bytes that are not a JSON object)."""
    if not data.startswith(b"{"):
        return None
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None
