"""An app's settings, validated in one place: at `App(...)`, and the whole app again at start."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mersal.errors import ConfigurationError
from mersal.numbers import is_count, is_seconds
from mersal.retry import RetryPolicy
from mersal.serialization import Codec, JsonCodec
from mersal.transport.limits import Limits
from mersal.urls import mask

log = logging.getLogger("mersal.app")

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}")
MAX_PREFETCH = 65_535  # an AMQP prefetch count is 16 bits
MAX_PARTITIONS = 256
WAITING_PER_SLOT = 8


@dataclass(frozen=True, slots=True)
class Settings:
    """What `App(...)` was given, checked: each field's `ConfigurationError` says what to change."""

    name: str
    database: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    concurrency: int = 32
    codec: Codec = field(default_factory=JsonCodec)
    max_body_size: int = 1024 * 1024
    grace_period: float = 30.0
    handler_timeout: float | None = 300.0
    prefetch: int | None = None
    consume: bool = True
    partitions: int | None = None

    def __post_init__(self) -> None:
        check_queue_name(self.name, "App(name)")
        check_concurrency(self.concurrency)
        check_kinds(self)
        set_ = object.__setattr__
        set_(self, "prefetch", prefetch_of(self.prefetch, self.concurrency))
        set_(self, "handler_timeout", timeout_of(self.handler_timeout))
        check_partitions(self.partitions, self.consume)
        set_(self, "database", self.database or os.environ.get("MERSAL_DATABASE") or None)
        check_queue_name(self.retry.error_queue, "RetryPolicy(error_queue)")
        if self.retry.error_queue == self.name:
            raise ConfigurationError(
                f"RetryPolicy(error_queue={self.name!r}) is the app's own queue: dead letters "
                "would come back to be handled again; name another queue"
            )

    @property
    def window(self) -> int:
        """How many deliveries the app takes at once: handled, or waiting behind their key."""
        assert self.prefetch is not None  # made an int by __post_init__
        return self.prefetch

    def with_concurrency(self, concurrency: int) -> Settings:
        """The same settings handling `concurrency` messages at once (the prefetch follows)."""
        return replace(self, concurrency=concurrency, prefetch=None)


def check_concurrency(concurrency: int) -> None:
    """Fail with a `ConfigurationError` unless `concurrency` is an int >= 1."""
    if not is_count(concurrency, 1):
        raise ConfigurationError(f"App(concurrency={concurrency!r}) must be an int >= 1")


def check_kinds(settings: Settings) -> None:
    """Fail with a `ConfigurationError` for a setting of the wrong kind or out of range."""
    if settings.database is not None and not isinstance(settings.database, str):
        raise ConfigurationError(
            f"App(database={settings.database!r}) must be a SQLAlchemy URL such as "
            "'postgresql+asyncpg://user@host/db' or 'sqlite+aiosqlite:///app.db'"
        )
    if not isinstance(settings.retry, RetryPolicy):
        raise ConfigurationError(
            f"App(retry={settings.retry!r}) must be a mersal.RetryPolicy, e.g. "
            "RetryPolicy(immediate=2, delayed=(1, 10))"
        )
    codec = settings.codec
    if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
        raise ConfigurationError(
            f"App(codec={codec!r}) must be a codec with encode() and decode(), such as "
            "mersal.serialization.JsonCodec(); leave it out for JSON"
        )
    size = settings.max_body_size
    if not is_count(size, 1):
        raise ConfigurationError(
            f"App(max_body_size={size!r}) must be a number of bytes, an int >= 1 "
            "(1048576 by default)"
        )
    grace = settings.grace_period
    if not is_seconds(grace):
        raise ConfigurationError(
            f"App(grace_period={grace!r}) must be a number of seconds >= 0 (30 by default)"
        )
    if not isinstance(settings.consume, bool):
        raise ConfigurationError(
            f"App(consume={settings.consume!r}) must be True (the app receives) or False "
            "(send-only)"
        )


def check_partitions(partitions: int | None, consume: bool) -> None:
    """Fail with a `ConfigurationError` unless `partitions` is None or a usable number."""
    if partitions is None:
        return
    if not is_count(partitions, 1, MAX_PARTITIONS):
        raise ConfigurationError(
            f"App(partitions={partitions!r}) must be an int from 1 to {MAX_PARTITIONS}"
        )
    if not consume:
        raise ConfigurationError(
            "App(partitions=...) splits the app's own queue, and a send-only app "
            "(consume=False) has none: leave partitions out"
        )


def prefetch_of(prefetch: int | None, concurrency: int) -> int:
    """The deliveries an app takes at once: handled, or waiting behind their partition key."""
    if prefetch is None:
        return min(MAX_PREFETCH, concurrency * (1 + WAITING_PER_SLOT))
    if not is_count(prefetch, concurrency):
        raise ConfigurationError(
            f"App(prefetch={prefetch!r}) must be an int >= concurrency ({concurrency})"
        )
    return min(prefetch, MAX_PREFETCH)


def timeout_of(timeout: float | None) -> float | None:
    """A handler timeout in seconds (None: none), or a `ConfigurationError`."""
    if timeout is None:
        return None
    if not is_seconds(timeout, zero=False, infinite=True):
        raise ConfigurationError(
            f"App(handler_timeout={timeout!r}) must be a number of seconds > 0, or None"
        )
    return None if math.isinf(timeout) else float(timeout)


def check_queue_name(name: str, what: str) -> None:
    """Fail with a `ConfigurationError` unless `name` is a usable queue name."""
    if not isinstance(name, str) or not QUEUE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"{what} = {name!r} is not a usable queue name: use 1-200 letters, digits and "
            "'_', '.', ':', '/', '-', starting with a letter or digit"
        )


# At start: the app as a whole.


@dataclass(frozen=True, slots=True)
class Wiring:
    """What an app was told to receive and send, for the checks at start."""

    settings: Settings
    routes: Mapping[type, str]
    subscriptions: Sequence[type]
    handled: Sequence[type]
    """Every type a handler (or a saga) was registered for."""
    timeouts: Sequence[type]
    """The timeout types of the app's sagas (they come back to its own queue)."""
    steps: Sequence[str]
    """The names of the incoming pipeline's steps."""

    def handles(self, message_type: type) -> bool:
        """Whether a handler runs for `message_type` (one for it, or for a base of it)."""
        return any(issubclass(message_type, handled) for handled in self.handled)

    def routed_home(self) -> list[type]:
        """The types routed to the app's own queue."""
        return [t for t, queue in self.routes.items() if queue == self.settings.name]


def check_at_start(wiring: Wiring, limits: Limits, address: str) -> None:
    """Refuse (`ConfigurationError`) what could never work once messages flow."""
    settings = wiring.settings
    longest = max(settings.retry.delayed, default=0.0)
    if longest > limits.max_delay:
        raise ConfigurationError(
            f"RetryPolicy(delayed=[..., {longest:g}, ...]) waits longer than the "
            f"{limits.max_delay:.0f}s the transport {mask(address)} can hold a message: use "
            "shorter delays"
        )
    if not settings.consume:
        check_send_only(wiring)
    for message_type in wiring.subscriptions:
        if not wiring.handles(message_type):
            name = message_type.__qualname__
            raise ConfigurationError(
                f"app {settings.name!r} subscribes to {name} but has no handler for it: "
                f"app.register({name}, handler)"
            )
    if "commit" not in wiring.steps:
        raise ConfigurationError(
            "app.incoming has no 'commit' step, so what handlers send (and, with a database, "
            "what they write) would never be committed: put it back, or replace it with a "
            "step that awaits context.transaction.commit()"
        )


def check_send_only(wiring: Wiring) -> None:
    """A send-only app receives nothing: refuse what would wait for a delivery."""
    name = wiring.settings.name
    received = [*wiring.subscriptions, *wiring.handled]
    if received:
        raise ConfigurationError(
            f"app {name!r} is send-only (consume=False) and receives nothing, yet it "
            f"subscribes to or handles {received[0].__qualname__}: drop the subscribe/register "
            "calls, or let it consume (App(consume=True), the default)"
        )
    home = wiring.routed_home()
    if home:
        raise ConfigurationError(
            f"app {name!r} is send-only (consume=False), so it has no queue of its own, "
            f"yet it routes {home[0].__qualname__} to {name!r}: route it to the app that "
            "handles it"
        )


def warn_at_start(wiring: Wiring) -> None:
    """Warn of types that reach the app's queue with no handler, and the reverse."""
    warn_unhandled(wiring)
    warn_undelivered(wiring)


def warn_unhandled(wiring: Wiring) -> None:
    """Warn of types routed to this app's own queue that no handler here takes."""
    for message_type in wiring.routed_home():
        if wiring.handles(message_type) or any(issubclass(h, message_type) for h in wiring.handled):
            continue  # handled, or its subclasses are: the route is theirs
        name = message_type.__qualname__
        log.warning(
            "app %r routes %s to its own queue but has no handler for it: every %s it "
            "receives is dead-lettered (NoHandler); app.register(%s, handler), or route %s "
            "to the app that handles it",
            wiring.settings.name,
            name,
            name,
            name,
            name,
        )


def warn_undelivered(wiring: Wiring) -> None:
    """Warn of handled types that no route to this app's queue or subscription brings."""
    home = [*wiring.routed_home(), *wiring.timeouts]
    for handled in _distinct(wiring.handled):
        if any(issubclass(t, handled) for t in wiring.subscriptions) or any(
            issubclass(t, handled) or issubclass(handled, t) for t in home
        ):
            continue
        name, queue = handled.__qualname__, wiring.settings.name
        log.warning(
            "app %r handles %s but neither routes it to its own queue nor subscribes to it: "
            "its handler runs only for a %s sent with send_local, routed here by another "
            "app or replied to this app; app.route(%s, %r) if this app receives it, "
            "app.subscribe(%s) if it is a published event",
            queue,
            name,
            name,
            name,
            queue,
            name,
        )


def _distinct(types: Iterable[type]) -> list[type]:
    return list(dict.fromkeys(types))
