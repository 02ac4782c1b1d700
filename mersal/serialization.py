"""Codecs that turn message objects into bytes and back: JSON by default."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgspec

from mersal.errors import DecodeError, EncodeError

MESSAGE_CLASSES = "a dataclass, a pydantic model, a msgspec Struct or an attrs class"
"""What a message is for the JSON codec."""
FIELD_TYPES = (
    "str, int, float, bool, None, list, dict with str keys, datetime, UUID, Decimal, enum, or a "
    "dataclass, pydantic model, msgspec Struct or attrs class"
)
"""What a message's fields may hold for the JSON codec."""
MAX_DEPTH = 20
"""How deep an encoding failure is looked for in nested fields."""


class Codec(Protocol):
    """Encodes message objects to bytes and decodes bytes into a given class.

    A codec may also have `accepts(cls) -> bool` and `supported: str` (what it accepts, in
    words): `register`, `route` and `subscribe` then refuse the classes it cannot carry, and
    sends refuse objects of other classes. With `validate(message, body) -> None` (an
    `EncodeError` when a receiver could not decode `body` as the message's class), every send
    is checked at the call.
    """

    content_type: str

    def encode(self, message: object) -> bytes:
        """The message as bytes."""
        ...

    def decode(self, body: bytes, cls: type) -> Any:
        """An instance of `cls` from bytes, or a `DecodeError` saying what is wrong."""
        ...


class JsonCodec:
    """JSON for dataclasses, msgspec Structs, pydantic models and attrs classes, validated."""

    content_type = "application/json"
    supported = MESSAGE_CLASSES
    """What a message class must be, in words."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder(enc_hook=_to_builtins)
        self._decoders: dict[type, msgspec.json.Decoder[Any]] = {}
        self._accepted: set[type] = set()

    def accepts(self, cls: type) -> bool:
        """Whether messages of class `cls` encode and decode."""
        if cls in self._accepted:  # asked at every send
            return True
        if is_message_class(cls):
            self._accepted.add(cls)
            return True
        return False

    def encode(self, message: object) -> bytes:
        """The message as compact UTF-8 JSON, or an `EncodeError` naming what cannot be."""
        try:
            body = self._encoder.encode(message)
        except Exception as error:
            raise encode_error(message, error, self._encoder.encode) from None
        if b"null" in body:  # where JSON has no number, the encoder writes null: refuse that
            refuse_non_finite(message)
        return body

    def validate(self, message: object, body: bytes) -> None:
        """An `EncodeError` naming the field unless `body` decodes as the message's class.

        The body is decoded as a receiver decodes it (with `decode`): msgspec's encoder does not
        check values against the class's annotations (a str in an int field encodes), the
        decoder does.
        """
        try:
            self.decode(body, type(message))
        except DecodeError as error:
            raise refusal(message, error) from None

    def decode(self, body: bytes, cls: type) -> Any:
        """An instance of `cls` validated from a JSON body."""
        decoder = self._decoders.get(cls)
        if decoder is None:  # a pydantic model, or a class not decoded before
            validate = getattr(cls, "model_validate_json", None)
            if validate is not None:
                return _decode_pydantic(validate, body, cls)
            decoder = self._decoders[cls] = _decoder(cls)
        try:
            return decoder.decode(body)
        except RecursionError:  # msgspec's answer to JSON nested deeper than the stack
            raise DecodeError(f"body nests too deeply to decode as {cls.__qualname__}") from None
        except msgspec.ValidationError as error:
            raise DecodeError(f"body does not match {cls.__qualname__}: {error}") from None
        except msgspec.DecodeError as error:
            raise DecodeError(f"body is not valid JSON for {cls.__qualname__}: {error}") from None


def _decoder(cls: type) -> msgspec.json.Decoder[Any]:
    """msgspec's decoder for `cls`, or a `DecodeError` when msgspec cannot decode that class."""
    try:
        return msgspec.json.Decoder(cls)
    except (TypeError, NameError) as error:  # an InitVar, a name the annotations cannot reach
        raise DecodeError(
            f"{cls.__qualname__} cannot be decoded from JSON ({type(error).__name__}: {error})"
        ) from None


def is_message_class(cls: type) -> bool:
    """Whether `cls` is a dataclass, a pydantic model, a msgspec Struct or an attrs class."""
    return (
        dataclasses.is_dataclass(cls)
        or issubclass(cls, msgspec.Struct)
        or hasattr(cls, "__attrs_attrs__")
        or callable(getattr(cls, "model_validate_json", None))
    )


def encode_error(message: object, error: Exception, encode: Callable[[Any], bytes]) -> EncodeError:
    """What could not be encoded in `message` (the field, when one is to blame), and the fix."""
    name = type(message).__qualname__
    cycle = _cycle(message)  # msgspec says RecursionError, pydantic "Circular reference"
    if cycle is not None or isinstance(error, RecursionError):
        return _too_deep(name, cycle)
    path, culprit = _unencodable(message, encode, MAX_DEPTH)
    reason = "" if isinstance(error, _Unsupported) else f" ({type(error).__name__}: {error})"
    if path:
        return EncodeError(
            f"cannot encode {name} as JSON: field {path.lstrip('.')} holds "
            f"{a_type(type(culprit))}{reason}; give the field a type JSON can carry "
            f"({FIELD_TYPES}) or convert the value before sending"
        )
    if not is_message_class(type(message)):
        return EncodeError(
            f"cannot encode {name} as JSON{reason}: a message is {MESSAGE_CLASSES}; make "
            f"{name} one (e.g. decorate it with @dataclass)"
        )
    return EncodeError(f"cannot encode {name} as JSON{reason}")


def _too_deep(name: str, found: tuple[str, str] | None) -> EncodeError:
    """Why a message nests deeper than the encoder goes: a part that holds its own container
    (`found`: its path and the container's), or depth alone."""
    if found is None:
        return EncodeError(
            f"cannot encode {name} as JSON: it nests too deeply; send a flatter {name}"
        )
    path, container = found
    held = f"field {container.lstrip('.')}" if container else "the message itself"
    return EncodeError(
        f"cannot encode {name} as JSON: field {path.lstrip('.')} holds {held} again (a cycle), "
        "which JSON cannot carry; send a copy without the cycle (an id in place of the object)"
    )


_PLAIN = str | bytes | int | float | bool | None
MAX_PARTS = 100_000
"""How many parts of a message the search for a cycle visits at most."""


def _cycle(message: object) -> tuple[str, str] | None:
    """The path to a part of `message` that is one of its own containers, and that one's path."""
    steps: list[str] = []  # the path to the part being looked at, one step a level
    holding: dict[int, int] = {}  # the containers around that part: their depth, by id
    todo: list[tuple[str, object, bool]] = [("", message, False)]
    for _ in range(MAX_PARTS):
        if not todo:
            break
        step, value, leaving = todo.pop()
        if leaving:
            del holding[id(value)]
            steps.pop()
            continue
        if isinstance(value, _PLAIN):
            continue
        if id(value) in holding:
            return "".join(steps) + step, "".join(steps[1 : holding[id(value)] + 1])
        steps.append(step)
        holding[id(value)] = len(steps) - 1
        todo.append((step, value, True))
        todo.extend((name, part, False) for name, part in reversed(list(_parts(value))))
    return None


def refusal(message: object, error: DecodeError) -> EncodeError:
    """Why a receiver would refuse the encoded `message` (`error`: its decode's), and the fix."""
    return EncodeError(f"cannot send {type(message).__qualname__}: {explain(message, error)}")


CONVERT = "convert the value before sending"
"""What to do about a value that does not decode as its field's type, when sending."""
_EXPECTED = re.compile(r"Expected `(.+)`, got `(.+)`")
_MISSING = re.compile(r"Object missing required field `(.+)`")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def explain(value: object, error: DecodeError, fix: str = CONVERT) -> str:
    """Why the encoding of `value` did not decode back as its class (`error`), then `fix`.

    Names the field and what it holds when the decoder (msgspec's or pydantic's) says which.
    """
    cause = error.__context__  # the decoder's own error, which `decode` raised its own from
    errors = getattr(cause, "errors", None)  # a pydantic ValidationError
    if callable(errors):
        return _pydantic_problem(type(value), errors(), fix)
    if isinstance(cause, msgspec.ValidationError):
        return _msgspec_problem(value, str(cause), fix)
    name = type(value).__qualname__
    if isinstance(cause, TypeError | NameError):
        return (
            f"no {name} can be decoded, whatever it holds ({type(cause).__name__}: {cause}); "
            f"change the class: fields of types the JSON codec decodes ({FIELD_TYPES}), "
            "each named where the class's module can find it"
        )
    if isinstance(cause, RecursionError):
        return f"it nests too deeply for a receiver to decode; send a flatter {name}"
    return f"it would not decode as {name} ({error}); {fix}"


def _msgspec_problem(message: object, text: str, fix: str) -> str:
    name = type(message).__qualname__
    reason, _, at = text.partition(" - at `$")
    path = at.rstrip("`")
    missing = _MISSING.fullmatch(reason)
    if missing is not None and missing[1].startswith("_"):
        field = f"{path}.{missing[1]}".lstrip(".")
        return (
            f"field {field} is left out of the encoding (msgspec does not encode an attrs "
            "class's fields whose names begin with an underscore), so it would not decode: "
            "rename the field without the underscore"
        )
    if not path:
        return f"it would not decode as {name} ({reason}); {fix}"
    path = _field_path(message, path)
    field = path.lstrip(".")
    found, value = _at(message, path)
    if not found:
        return f"field {field} would not decode as {name} declares it ({reason}); {fix}"
    held = f"holds {_held(value)}"
    if callable(getattr(value, "model_validate_json", None)):
        return (
            f"field {field} holds a pydantic model ({type(value).__qualname__}), which only a "
            f"pydantic model can hold: make {name} a pydantic model too, or "
            f"{type(value).__qualname__} a dataclass"
        )
    expected = _EXPECTED.fullmatch(reason)
    if expected is not None:
        return f"field {field} {held} where {name} declares {expected[1]}; {fix}"
    return f"field {field} {held}, which {name} refuses ({reason}); {fix}"


def _field_path(message: object, path: str) -> str:
    """`path` with the index into an array_like Struct (`[1]`) written as its field (`.qty`)."""
    if not isinstance(message, msgspec.Struct) or not message.__struct_config__.array_like:
        return path  # nested array_like Structs keep their indexes
    first = _STEP.match(path)
    if first is None or first[2] is None or not first[2].isdigit():
        return path
    fields = msgspec.structs.fields(type(message))
    index = int(first[2]) - (message.__struct_config__.tag is not None)  # the tag comes first
    if not 0 <= index < len(fields):
        return path
    return f".{fields[index].encode_name}{path[first.end() :]}"


def _at(value: object, path: str) -> tuple[bool, object]:
    """The part of `value` at a msgspec error path (`.items[0].qty`), if it can be found."""
    for step in _STEP.finditer(path):
        name, index = step.groups()
        if name is not None:
            fields = _wire_names(type(value))
            if name not in fields:
                return False, None
            try:
                value = getattr(value, fields[name])
            except AttributeError:  # a field never set
                return False, None
        elif index == "..." or not isinstance(value, list | tuple | set | frozenset):
            return False, None  # a dict value (msgspec does not name the key)
        else:
            items = list(value)
            if int(index) >= len(items):
                return False, None
            value = items[int(index)]
    return True, value


def _wire_names(cls: type) -> dict[str, str]:
    """The attribute of each field by the name it is encoded under."""
    if issubclass(cls, msgspec.Struct):
        return {f.encode_name: f.name for f in msgspec.structs.fields(cls)}
    return {name: name for name in _field_names(cls)}


def _pydantic_problem(cls: type, errors: list[dict[str, Any]], fix: str) -> str:
    first = errors[0]
    loc = first.get("loc", ())
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    field = field.lstrip(".")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    value = first.get("input")
    name = cls.__qualname__
    if (
        first.get("type") == "extra_forbidden"
        and loc
        and loc[0] in getattr(cls, "model_computed_fields", {})
    ):
        return (
            f"field {field} is a computed field, which {name} refuses when it decodes its own "
            "encoding (extra='forbid'): let the model ignore extra fields, or drop the computed "
            "field"
        )
    if first.get("type") == "missing":
        return (
            f"field {field} is not in {name}'s encoding (left out by Field(exclude=True), a "
            "serialization alias, a serializer or model_construct), so it would not decode: "
            f"have the encoding carry it, or give the field a default{more}"
        )
    return (
        f"field {field} holds {_held(value)}, which {name} refuses: {first.get('msg')}{more}; {fix}"
    )


def _held(value: object) -> str:
    """A value as a refusal shows it: 'a str ('9.5')', 'None'."""
    return "None" if value is None else f"{a_type(type(value))} ({value!r:.80})"


def a_type(cls: type) -> str:
    """A class name with its article: 'a str', 'an int'."""
    name = cls.__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def refuse_non_finite(message: object) -> None:
    """An `EncodeError` if a float in `message` is infinite or NaN, which JSON cannot carry."""
    found = _non_finite(message, MAX_DEPTH)
    if found is not None:
        path, value = found
        raise EncodeError(
            f"cannot encode {type(message).__qualname__} as JSON: field {path.lstrip('.')} holds "
            f"{value!r}, which JSON cannot carry (it would arrive as null): send a finite number"
        )


def _non_finite(value: object, depth: int) -> tuple[str, float] | None:
    """The path to a float in `value` that is infinite or NaN, and that float."""
    if isinstance(value, float):
        return None if math.isfinite(value) else ("", value)
    if depth <= 0 or isinstance(value, str | bytes | int):
        return None
    for name, part in _parts(value):
        found = _non_finite(part, depth - 1)
        if found is not None:
            return f"{name}{found[0]}", found[1]
    return None


def _unencodable(value: object, encode: Callable[[Any], bytes], depth: int) -> tuple[str, object]:
    """The path to the innermost part of `value` that does not encode, and that part."""
    if depth > 0:
        for name, part in _parts(value):
            try:
                encode(part)
            except Exception:
                path, culprit = _unencodable(part, encode, depth - 1)
                return f"{name}{path}", culprit
    return "", value


def _parts(value: object) -> Iterator[tuple[str, object]]:
    """The named parts of a message or container value, as a path suffix and the part."""
    if isinstance(value, dict):
        yield from ((f"[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        yield from ((f"[{index}]", item) for index, item in enumerate(value))
    else:
        for field in _field_names(type(value)):
            yield f".{field}", getattr(value, field, None)


def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    names = getattr(cls, "__struct_fields__", None)  # a msgspec Struct
    if names is None:
        names = [attribute.name for attribute in getattr(cls, "__attrs_attrs__", ())]
    return list(names or getattr(cls, "model_fields", ()))


class _Unsupported(TypeError):
    """An object of a type the JSON encoder does not know."""


def _to_builtins(value: object) -> Any:
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json", by_alias=True)
    raise _Unsupported(type(value).__qualname__)


def _decode_pydantic(validate: Any, body: bytes, cls: type) -> Any:
    try:
        return validate(body)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        reason = str(error).replace("\n", "; ")
        raise DecodeError(f"body does not match {cls.__qualname__}: {reason}") from None
