"""Handler signatures: which parameter receives the message, which the context, checked once."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mersal.context import MessageContext
from mersal.errors import ConfigurationError

Handle = Callable[[Any], Awaitable[object]]
Bind = Callable[[Callable[..., Awaitable[object]], MessageContext], Handle]

MESSAGE, CONTEXT = 0, 1
"""What a parameter receives: the message or its MessageContext."""

_TRUSTED_CONTEXT = object()
"""An annotation naming MessageContext that does not resolve at run time."""
_EMPTY = inspect.Parameter.empty
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True, slots=True)
class Binding:
    """How to call a handler: what each positional argument and keyword argument receives."""

    positional: tuple[int, ...]
    keywords: tuple[tuple[str, int], ...] = ()

    @property
    def message_only(self) -> bool:
        """Whether the handler is called with the message alone, `handler(message)`."""
        return self.positional == (MESSAGE,) and not self.keywords


@dataclass(frozen=True, slots=True)
class _Signature:
    """A handler's parameters as seen at register, and how its errors name it."""

    name: str  # what was registered: "handle", "Handler", "Charger instance"
    where: str  # whose parameters: "handle", "Handler.__call__"
    form: str  # "async def handle({})", "async def __call__(self, {})"
    parameters: list[inspect.Parameter]
    hints: dict[str, Any]
    message_type: type
    decorated: bool = False  # a decorator's wrapper: it may fill parameters itself

    def label(self, parameter: inspect.Parameter) -> str:
        hint = self.hints.get(parameter.name, _EMPTY)
        return parameter.name if hint is _EMPTY else f"{parameter.name}: {hint_name(hint)}"

    def suggested(self, parameter: inspect.Parameter) -> str:
        """The message parameter as it should read: annotated with the registered type."""
        hint = self.hints.get(parameter.name, _EMPTY)
        if _is_wildcard(hint):
            return f"{parameter.name}: {self.message_type.__qualname__}"
        return self.label(parameter)

    def written(self, *parameters: str) -> str:
        return f"`{self.form.format(', '.join(parameters))}`"


def function_binding(function: Any, message_type: type) -> Binding:
    """Bind an async function's (or async callable object's) parameters, or refuse it."""
    target: Any
    is_object = False
    if type(function) in (types.FunctionType, types.MethodType):  # not a mock posing as one
        where, target = name_of(function), function
        self = "self, " if inspect.ismethod(function) else ""
        form = f"async def {function.__name__}({self}{{}})"
    elif isinstance(function, functools.partial):
        where, form, target = name_of(function.func), "async def handle({})", function.func
    else:
        where, is_object = f"{type(function).__qualname__}.__call__", True
        form, target = "async def __call__(self, {})", type(function).__call__
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a compiled callable without a signature: as before
        return Binding((MESSAGE,))
    if is_object and _opaque(parameters):
        return Binding((MESSAGE,))  # an object taking anything (a mock): the message alone
    if target is function:
        _refuse_unbound(function, parameters, message_type)
    hints = _hints(where, target, parameters)
    decorated = inspect.unwrap(target) is not target
    signature = _Signature(
        name_of(function), where, form, parameters, hints, message_type, decorated
    )
    return _bind(signature, takes_context=True)


def _refuse_unbound(function: Any, parameters: list[inspect.Parameter], message_type: type) -> None:
    """Refuse a method taken from its class, `Orders.place`: `self` would get the message."""
    owner = function.__qualname__.rpartition(".")[0]
    if inspect.ismethod(function) or not owner or owner.endswith("<locals>"):
        return
    if not parameters or parameters[0].name != "self":
        return
    cls = owner.rpartition(".")[2]
    raise ConfigurationError(
        f"{name_of(function)} is a method taken from its class, so its `self` would receive "
        f"the message or its context: register an instance's method, "
        f"`{cls}(...).{function.__name__}`, or register {cls} as a handler class with "
        f"`async def __call__(self, message: {message_type.__qualname__})`"
    )


def class_binding(cls: type, message_type: type) -> Binding:
    """Bind a handler class's `__call__` parameters (the message only), or refuse it."""
    call = cls.__call__
    parameters = list(inspect.signature(call).parameters.values())
    if parameters and parameters[0].kind not in _VARIADIC:
        parameters = parameters[1:]  # after self
    if _opaque(parameters):  # a decorator without functools.wraps: called as it always was
        return Binding((MESSAGE,))
    where = f"{cls.__qualname__}.__call__"
    hints = _hints(where, call, parameters)
    form = "async def __call__(self, {})"
    signature = _Signature(cls.__qualname__, where, form, parameters, hints, message_type)
    return _bind(signature, takes_context=False)


def binder(binding: Binding) -> Bind:
    """Call a handler as its binding says: decided once, a closure per message."""
    if binding.message_only:
        return _as_is
    if binding == Binding((MESSAGE, CONTEXT)):
        return _message_then_context
    if binding == Binding((CONTEXT, MESSAGE)):
        return _context_then_message
    positional, keywords = binding.positional, binding.keywords

    def bind(target: Callable[..., Awaitable[object]], context: MessageContext) -> Handle:
        async def call(message: Any) -> object:
            values = (message, context)
            args = [values[role] for role in positional]
            return await target(*args, **{name: values[role] for name, role in keywords})

        return call

    return bind


def _as_is(target: Callable[..., Awaitable[object]], context: MessageContext) -> Handle:
    return target


def _message_then_context(
    target: Callable[..., Awaitable[object]], context: MessageContext
) -> Handle:
    async def call(message: Any) -> object:
        return await target(message, context)

    return call


def _context_then_message(
    target: Callable[..., Awaitable[object]], context: MessageContext
) -> Handle:
    async def call(message: Any) -> object:
        return await target(context, message)

    return call


def _bind(signature: _Signature, *, takes_context: bool) -> Binding:
    hints = signature.hints
    named = [p for p in signature.parameters if p.kind not in _VARIADIC]
    contexts = [p for p in named if _is_context(hints.get(p.name, _EMPTY))]
    if len(contexts) > 1 and takes_context:
        raise ConfigurationError(
            f"{signature.where} takes the MessageContext twice "
            f"({', '.join(f'`{p.name}`' for p in contexts)}): keep one"
        )
    candidates = [p for p in named if p not in contexts]
    message = _message_parameter(signature, candidates)
    roles = {message.name: MESSAGE}
    if takes_context:
        others = [p for p in candidates if p is not message]
        context = contexts[0] if contexts else _unannotated_context(signature, others)
        if context is not None:
            roles[context.name] = CONTEXT
    for parameter in named:
        if parameter.name not in roles and parameter.default is _EMPTY and not signature.decorated:
            _refuse_extra(signature, parameter, message, takes_context=takes_context)
    return _call_shape(signature, roles)


def _message_parameter(
    signature: _Signature, candidates: list[inspect.Parameter]
) -> inspect.Parameter:
    """The parameter annotated for the registered type, else the first one (unannotated)."""
    hints, message_type = signature.hints, signature.message_type
    if not candidates:
        written = signature.written(f"message: {message_type.__qualname__}")
        if any(p.kind in _VARIADIC for p in signature.parameters):
            raise ConfigurationError(
                f"{signature.where} takes no message, only *args/**kwargs: write {written}, "
                "or, if it is a decorator's wrapper, decorate it with "
                "`@functools.wraps(handler)` so that the handler's own signature shows"
            )
        raise ConfigurationError(f"{signature.where} takes no message: write {written}")
    for parameter in candidates:
        hint = hints.get(parameter.name, _EMPTY)
        if not _is_wildcard(hint) and accepts(hint, message_type):
            return parameter
    first = candidates[0]
    hint = hints.get(first.name, _EMPTY)
    if not _is_wildcard(hint) and not _maybe_local(signature, first):
        registered = message_type.__qualname__
        plain = isinstance(hint, type) and not typing.get_args(hint)
        instead = f"register it for {hint_name(hint)}, or " if plain else ""
        raise ConfigurationError(
            f"{signature.name} is registered for {registered} but its message parameter "
            f"`{first.name}` is annotated {hint_name(hint)}: {instead}annotate "
            f"`{first.name}: {registered}`"
        )
    return first


def _maybe_local(signature: _Signature, parameter: inspect.Parameter) -> bool:
    """Whether a string annotation may name a class local to the function defining the handler,
    which its module (where the string was evaluated) does not see: it is taken on trust."""
    return isinstance(parameter.annotation, str) and "<locals>" in signature.where


def _unannotated_context(
    signature: _Signature, candidates: list[inspect.Parameter]
) -> inspect.Parameter | None:
    """The `(message, context)` form: the next unannotated parameter, required or `= None`."""
    for parameter in candidates:
        if (parameter.default is _EMPTY or parameter.default is None) and _is_wildcard(
            signature.hints.get(parameter.name, _EMPTY)
        ):
            return parameter
    return None


def _refuse_extra(
    signature: _Signature,
    parameter: inspect.Parameter,
    message: inspect.Parameter,
    *,
    takes_context: bool,
) -> None:
    label = signature.suggested(message)
    head = f"{signature.where}'s parameter `{signature.label(parameter)}` would receive nothing"
    if not takes_context:
        owner = signature.where.removesuffix(".__call__")
        raise ConfigurationError(
            f"{head}: write {signature.written(label)} and take the context and other "
            f"dependencies in {owner}.__init__"
        )
    raise ConfigurationError(
        f"{head}: a handler function takes the message and, if it wants, the context, e.g. "
        f"{signature.written(label, 'context: MessageContext')}; take other dependencies in "
        f"a handler class's __init__, bind it before registering "
        f"(`functools.partial(handler, {parameter.name}=...)`), or give `{parameter.name}` a "
        "default"
    )


def _call_shape(signature: _Signature, roles: dict[str, int]) -> Binding:
    """Positional arguments while no parameter is skipped, keywords after."""
    positional: list[int] = []
    keywords: list[tuple[str, int]] = []
    skipped: str | None = None
    for parameter in signature.parameters:
        role = roles.get(parameter.name)
        if parameter.kind is parameter.KEYWORD_ONLY and role is not None:
            keywords.append((parameter.name, role))
        elif parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            if role is None:
                skipped = skipped or parameter.name
            elif skipped is None:
                positional.append(role)
            elif parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
                keywords.append((parameter.name, role))
            else:
                raise ConfigurationError(
                    f"{signature.where} cannot be given `{parameter.name}`: it is positional-only "
                    f"and comes after `{skipped}`, which receives nothing; put it first"
                )
    return Binding(tuple(positional), tuple(keywords))


def accepts(hint: Any, message_type: type) -> bool:
    """Whether a parameter annotated `hint` can receive a `message_type` message."""
    if _is_wildcard(hint):
        return True
    if isinstance(hint, typing.TypeVar):
        if hint.__bound__ is not None:
            return accepts(hint.__bound__, message_type)
        return not hint.__constraints__ or any(
            accepts(c, message_type) for c in hint.__constraints__
        )
    if type(hint).__name__ == "TypeAliasType":  # `type Events = Ping | Pong` (3.12)
        return accepts(hint.__value__, message_type)
    if is_union(hint):
        return any(accepts(member, message_type) for member in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if isinstance(origin, type):
        hint = origin  # a parametrised generic class: Envelope[int] takes an Envelope
    if not isinstance(hint, type):
        return False
    if getattr(hint, "_is_protocol", False):
        return True  # structural: taken on trust
    try:
        return issubclass(message_type, hint)
    except TypeError:
        return False


def is_union(hint: object) -> bool:
    """Whether `hint` is `A | B` or `Union[A, B]` (`Optional[A]` included)."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def hint_name(hint: Any) -> str:
    """An annotation as written: `Ping`, `Ping | None`, `list[int]`."""
    if hint is type(None):
        return "None"
    if isinstance(hint, typing.NewType):
        return hint.__name__
    if is_union(hint):
        return " | ".join(hint_name(member) for member in typing.get_args(hint))
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__qualname__
    return repr(hint).replace("typing.", "")


def name_of(thing: Any) -> str:
    """A handler, class or function as its errors name it."""
    name = getattr(thing, "__qualname__", None)
    if isinstance(name, str):
        return name
    if callable(thing) and not isinstance(thing, functools.partial):
        return f"{type(thing).__qualname__} instance"
    return repr(thing)


def _is_context(hint: Any) -> bool:
    if hint is _TRUSTED_CONTEXT:
        return True
    if is_union(hint):
        return any(_is_context(member) for member in typing.get_args(hint))
    return hint is MessageContext


def _opaque(parameters: list[inspect.Parameter]) -> bool:
    """Whether the parameters are `*args` (and `**kwargs`) alone: they say nothing."""
    return any(p.kind is p.VAR_POSITIONAL for p in parameters) and all(
        p.kind in _VARIADIC for p in parameters
    )


def _is_wildcard(hint: Any) -> bool:
    return hint is _EMPTY or hint is Any or hint is object


def _hints(where: str, function: Any, parameters: list[inspect.Parameter]) -> dict[str, Any]:
    """The parameters' annotations, evaluated (the return annotation is not read).

    A name that does not resolve (imported under `if TYPE_CHECKING:`) is taken on trust: as the
    context when it names MessageContext, else as an unchecked message annotation.
    """
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    hints: dict[str, Any] = {}
    for parameter in parameters:
        if parameter.annotation is not _EMPTY:
            hints[parameter.name] = _evaluated(where, parameter.annotation, namespace)
    return hints


def _evaluated(where: str, annotation: Any, namespace: dict[str, Any]) -> Any:
    holder = types.SimpleNamespace(__annotations__={"hint": annotation})
    try:
        return typing.get_type_hints(holder, globalns=namespace)["hint"]
    except NameError as error:
        if not isinstance(annotation, str):
            raise _unreadable(where, error) from None
        written = annotation.strip().strip("'\"")
        return _TRUSTED_CONTEXT if written.rpartition(".")[2] == MessageContext.__name__ else Any
    except Exception as error:
        raise _unreadable(where, error) from None


def _unreadable(where: str, error: Exception) -> ConfigurationError:
    if isinstance(error, SyntaxError):
        advice = "write each annotation as a Python expression"
    else:
        advice = "import the annotated types at module level"
    return ConfigurationError(f"cannot read the type hints of {where} ({error}): {advice}")
