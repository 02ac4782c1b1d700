"""Handler registrations and their activation: one dependency scope per message."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from lagom import Container

from mersal.binding import Binding, Handle, binder, class_binding, function_binding, name_of
from mersal.context import MessageContext
from mersal.errors import ConfigurationError

Provider = Callable[[MessageContext], object]

M = TypeVar("M")
M_contra = TypeVar("M_contra", contravariant=True)


class Handles(Protocol[M_contra]):
    """A handler class's instances: called with each message of the type it handles."""

    def __call__(self, message: M_contra, /) -> Awaitable[object]:
        """Handle one message."""
        ...


Handler = (
    type[Handles[M]]
    | Callable[[M], Awaitable[object]]
    | Callable[[M, MessageContext], Awaitable[object]]
    | Callable[[MessageContext, M], Awaitable[object]]
)
"""What `App.register` takes for messages of type M: a class, or an async function.

The type spells the positional forms; `mersal.binding` checks every signature at register.
"""

_UNBUILDABLE = (str, int, float, bool, bytes, complex, list, dict, set, tuple, type(None))
_SESSION = ("sqlalchemy.ext.asyncio.session", "AsyncSession")
"""SQLAlchemy's AsyncSession, by module and name: the core does not import SQLAlchemy."""
_CONNECTION = ("sqlalchemy.ext.asyncio.engine", "AsyncConnection")
_SYNC_SESSION = ("sqlalchemy.orm.session", "Session")


@dataclass(slots=True)
class _Registration:
    message_type: type
    handler: Any
    build: Callable[[MessageContext], Handle]
    classes: tuple[type, ...]
    """The classes built per message to run the handler: its own, or a saga's."""


class Handlers:
    """Which handlers run for which message type, and how each is built per message."""

    def __init__(self, container: Container | None) -> None:
        if container is not None and not isinstance(container, Container):
            raise ConfigurationError(
                f"App(container={container!r}) must be a lagom.Container, or left out"
            )
        self.container = container if container is not None else Container()
        self.scoped: dict[type, Provider] = {}
        self._registrations: list[_Registration] = []
        self._built: list[type] = []
        self._by_type: dict[type, list[_Registration]] = {}
        self._needs: dict[tuple[type, Callable[[Any], bool]], bool] = {}

    def provide(self, dependency: type, provider: Provider) -> None:
        """Resolve `dependency` per message from the message's context (App, session, …)."""
        self.scoped[dependency] = provider

    def add(self, message_type: type, handler: Any, *, builds: tuple[type, ...] = ()) -> None:
        """Run `handler` (a class resolved per message, or an async function) for the type.

        `builds`: the classes a function handler builds per message with `builder` (a saga's).
        """
        if not isinstance(message_type, type):
            raise ConfigurationError(f"register a message class, not {message_type!r}")
        for existing in self._registrations:
            if existing.message_type is message_type and existing.handler is handler:
                raise ConfigurationError(
                    f"{name_of(handler)} is already registered for {message_type.__qualname__}"
                )
        build = self._builder(message_type, handler)
        classes = (handler, *builds) if inspect.isclass(handler) else builds
        self._registrations.append(_Registration(message_type, handler, build, classes))
        self._by_type.clear()
        self._needs.clear()

    def builder(self, cls: type) -> Callable[[MessageContext], object]:
        """Build instances of `cls` per message like handler classes (a saga, say)."""
        self._built.append(cls)
        return self._class_builder(cls, _parameters(cls))

    @property
    def message_types(self) -> list[type]:
        """Every type a handler was registered for."""
        return list(dict.fromkeys(r.message_type for r in self._registrations))

    def has_handler(self, message_type: type) -> bool:
        """Whether any handler runs for `message_type` (including handlers for its bases)."""
        return bool(self._matching(message_type))

    def check(self) -> None:
        """Fail with a `ConfigurationError` if a handler needs something nobody provides."""
        classes = [r.handler for r in self._registrations if inspect.isclass(r.handler)]
        for cls in (*classes, *self._built):
            for name, dependency in _parameters(cls):
                self._check_resolvable(cls, name, dependency, ())

    def needs(self, message_type: type, wanted: Callable[[Any], bool]) -> bool:
        """Whether a handler of the type asks for a dependency that is `wanted`.

        Handler classes' constructors are read, and those of the classes they ask for in turn;
        a dependency the container or a provider gives is not looked into.
        """
        key = (message_type, wanted)
        found = self._needs.get(key)
        if found is None:
            classes = [cls for r in self._matching(message_type) for cls in r.classes]
            found = self._needs[key] = any(self._asks(cls, wanted, 0) for cls in classes)
        return found

    def _asks(self, cls: type, wanted: Callable[[Any], bool], depth: int) -> bool:
        try:
            parameters = _parameters(cls)
        except ConfigurationError:
            return False
        for _, dependency in parameters:
            if wanted(dependency):
                return True
            opaque = dependency in self.scoped or self.container.get_definition(dependency)
            readable = not opaque and inspect.isclass(dependency) and depth < 20
            if (
                readable
                and dependency not in _UNBUILDABLE
                and self._asks(dependency, wanted, depth + 1)
            ):
                return True
        return False

    def activate(self, message_type: type, context: MessageContext) -> list[Handle]:
        """Build every handler for the message's type, in registration order."""
        return [r.build(context) for r in self._matching(message_type)]

    def _matching(self, message_type: type) -> list[_Registration]:
        found = self._by_type.get(message_type)
        if found is None:
            found = [r for r in self._registrations if issubclass(message_type, r.message_type)]
            self._by_type[message_type] = found
        return found

    def _builder(self, message_type: type, handler: Any) -> Callable[[MessageContext], Handle]:
        """Check the handler's signature against the type once; bind its arguments per message."""
        if inspect.isclass(handler):
            call = getattr(handler, "__call__", None)  # noqa: B004
            if call is type.__call__ or not inspect.iscoroutinefunction(call):
                raise ConfigurationError(
                    f"handler class {_name(handler)} needs an "
                    f"`async def __call__(self, message: {message_type.__qualname__})`"
                )
            build = self._class_builder(handler, _parameters(handler))
            binding = class_binding(handler, message_type)
            if binding.message_only:
                return build
            bind = binder(binding)
            return lambda context: bind(build(context), context)
        if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 (an async callable object)
        ):
            return _function_builder(handler, function_binding(handler, message_type))
        raise ConfigurationError(_not_a_handler(handler, message_type))

    def _class_builder(
        self, cls: type, parameters: list[tuple[str, Any]]
    ) -> Callable[[MessageContext], Any]:
        scoped = self.scoped

        def build(context: MessageContext) -> Any:
            kwargs: dict[str, object] = {}
            for name, dependency in parameters:
                provider = scoped.get(dependency)
                if provider is not None:
                    kwargs[name] = provider(context)
                else:
                    kwargs[name] = self._resolve(dependency, context)
            return cls(**kwargs)

        return build

    def _resolve(self, dependency: Any, context: MessageContext) -> object:
        """Resolve from the message's scope: one instance per dependency per message."""
        resolved: dict[Any, object] | None = context.items.get("mersal.resolved")
        if resolved is None:
            resolved = context.items["mersal.resolved"] = {}
        elif dependency in resolved:
            return resolved[dependency]
        scope: Container | None = context.items.get("mersal.scope")
        if scope is None:
            scope = Container(self.container)
            for scoped, provider in self.scoped.items():
                scope[scoped] = _deferred(provider, context)  # type: ignore[assignment]
            context.items["mersal.scope"] = scope
        instance = resolved[dependency] = scope.resolve(dependency)
        return instance

    def _check_resolvable(
        self,
        handler: type,
        name: str,
        dependency: Any,
        path: tuple[str, ...],
        owner: Any = None,
    ) -> None:
        if dependency in self.scoped or self.container.get_definition(dependency) is not None:
            return
        trail = " -> ".join((*path, f"{name}: {_name(dependency)}"))
        if _is_session(dependency) or _is_connection(dependency):
            what = "session" if _is_session(dependency) else "connection"
            raise ConfigurationError(
                f"handler {_name(handler)} needs {trail}, the message's database {what}, but "
                "the app has no database: pass App(database='postgresql+asyncpg://...') (or "
                f"set MERSAL_DATABASE), or drop the {what} from the handler"
            )
        if _is_sync_session(dependency):
            raise ConfigurationError(
                f"handler {_name(handler)} needs {trail}, SQLAlchemy's synchronous session, "
                "which Mersal does not provide: ask for the message's "
                "sqlalchemy.ext.asyncio.AsyncSession instead"
            )
        if dependency in _UNBUILDABLE:
            raise ConfigurationError(
                f"handler {_name(handler)} needs {trail}, and a {_name(dependency)} cannot be "
                f"injected by its type: give `{name}` a default, or "
                f"{self._instead(handler, owner)}"
            )
        if (
            not inspect.isclass(dependency)
            or inspect.isabstract(dependency)
            or getattr(dependency, "_is_protocol", False)
            or len(path) > 20
        ):
            raise self._unprovided(handler, trail, dependency)
        try:
            parameters = _parameters(dependency)
        except ConfigurationError:  # a library's class: hints that do not resolve, or none
            why = f" (nor can it be built: {_unreadable(dependency)})"
            raise self._unprovided(handler, trail, dependency, why) from None
        for inner_name, inner in parameters:
            self._check_resolvable(
                handler, inner_name, inner, (*path, f"{name}: {_name(dependency)}"), dependency
            )

    def _instead(self, handler: type, owner: Any) -> str:
        """What else gives a value the container cannot: the instance built by the caller."""
        if owner is not None:  # a dependency's own parameter: the container takes the instance
            where = _name(owner)
            return (
                f"bind {where} in the lagom Container passed as App(container=...), e.g. "
                f"container[{where}] = {where}(...)"
            )
        if handler in self._built:  # a saga, built by the app for every message
            return "ask for a class of yours that holds it, which the container builds or is given"
        return f"register an instance, {_name(handler)}(...), in place of the class"

    @staticmethod
    def _unprovided(
        handler: type, trail: str, dependency: Any, why: str = ""
    ) -> ConfigurationError:
        return ConfigurationError(
            f"handler {_name(handler)} needs {trail}, which nobody provides{why}: bind it in the "
            f"lagom Container passed as App(container=...), "
            f"e.g. container[{_name(dependency)}] = ..."
        )


def _deferred(provider: Provider, context: MessageContext) -> Callable[[], object]:
    """`provider` for the container: called only if something the container builds needs it."""
    return lambda: provider(context)


def _function_builder(function: Any, binding: Binding) -> Callable[[MessageContext], Handle]:
    if binding.message_only:
        return lambda context: function
    bind = binder(binding)
    return lambda context: bind(function, context)


def _not_a_handler(handler: Any, message_type: type) -> str:
    written = (
        f"async def {getattr(handler, '__name__', 'handle')}(message: {message_type.__qualname__})"
    )
    if inspect.isasyncgenfunction(handler):
        return f"{name_of(handler)} is an async generator (it yields): write `{written}`"
    if inspect.isfunction(handler) or inspect.ismethod(handler):
        return f"{name_of(handler)} is not async: write `{written}`"
    return (
        f"{name_of(handler)} is not a handler: register a class with `async def __call__(self, "
        f"message: {message_type.__qualname__})` or an `async def` function taking the message"
    )


def _parameters(cls: type) -> list[tuple[str, Any]]:
    """The constructor's required parameters and their annotated types."""
    init = cls.__init__  # type: ignore[misc]
    if init is object.__init__:
        return []
    try:
        hints = typing.get_type_hints(init)
    except Exception as error:
        raise ConfigurationError(
            f"cannot read the type hints of {_name(cls)}.__init__ ({error}): "
            "import the annotated types at module level"
        ) from None
    found: list[tuple[str, Any]] = []
    for name, parameter in inspect.signature(init).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is not parameter.empty:
            continue
        if name not in hints:
            raise ConfigurationError(
                f"{_name(cls)}.__init__ parameter {name!r} has no type hint: annotate it so "
                "the container knows what to inject"
            )
        found.append((name, hints[name]))
    return found


def _unreadable(cls: type) -> str:
    """Why `_parameters` cannot read what `cls.__init__` needs: its hints, unresolved or missing."""
    init = cls.__init__  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(init)
    except Exception:
        return f"{_name(cls)}.__init__'s type hints do not resolve"
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for name, parameter in inspect.signature(init).parameters.items():
        required = parameter.default is parameter.empty and parameter.kind not in variadic
        if required and name != "self" and name not in hints:
            return f"{_name(cls)}.__init__'s parameter {name!r} has no type hint"
    return f"{_name(cls)}.__init__'s type hints cannot be read"


def _is_sync_session(dependency: Any) -> bool:
    module = getattr(dependency, "__module__", None)
    return (module, getattr(dependency, "__qualname__", None)) == _SYNC_SESSION


def _is_session(dependency: Any) -> bool:
    module = getattr(dependency, "__module__", None)
    return (module, getattr(dependency, "__qualname__", None)) == _SESSION


def _is_connection(dependency: Any) -> bool:
    module = getattr(dependency, "__module__", None)
    return (module, getattr(dependency, "__qualname__", None)) == _CONNECTION


def _name(thing: Any) -> str:
    return getattr(thing, "__qualname__", None) or repr(thing)
