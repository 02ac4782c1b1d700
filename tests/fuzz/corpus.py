"""Hostile inputs shared by the property tests and the fuzz target (no Hypothesis here)."""

from __future__ import annotations

import json
import math
import sys

# Type names a hostile producer might try, hoping that the name is imported and called.
HOSTILE_NAMES: tuple[str, ...] = (
    "os.system",
    "os.popen",
    "builtins.eval",
    "builtins.exec",
    "builtins.__import__",
    "__import__",
    "eval",
    "subprocess.Popen",
    "subprocess.run",
    "pickle.loads",
    "marshal.loads",
    "importlib.import_module",
    "ctypes.CDLL",
    "antigravity.fly",
    "this.s",
    "turtle.Turtle",
    "webbrowser.open",
    "smtplib.SMTP",
    "xmlrpc.server.SimpleXMLRPCServer",
    "tests.fuzz.canary.Boom",
    "..",
    ".",
    "os..system",
    ".os.system",
    "os.system.",
    "os/system",
    "os:system",
    "os.path.join",
    "__main__.App",
    "mersal.App",
    "mersal.app.App",
    "mersal.errors.MersalError",
    "fuzz.Order.v1 ",
    " fuzz.Order.v1",
    "fuzz.Order.v1\x00",
    "fuzz.Order.v1\n",
    "FUZZ.ORDER.V1",
    "fuzz.Order.v2",
    "fuzz.\u039frder.v1",  # a Greek capital omicron, not an O
    "fuzz.Order.v1\u200b",
    "\x00",
    "\x00os.system",
    "os\x00.system",
    "\ud800",
    "名前.型",
    "a" * 1_024,
    "a." * 5_000,
    "x" * 100_000,
)

# Modules no test imports: if one shows up in sys.modules, a type name imported it.
CANARY_MODULES: tuple[str, ...] = (
    "antigravity",
    "this",
    "turtle",
    "smtplib",
    "xmlrpc.server",
    "tests.fuzz.canary",
)

CONTENT_TYPES: tuple[str, ...] = (
    "application/x-python-pickle",
    "application/python-pickle",
    "application/x-pickle",
    "application/x-marshal",
    "application/x-msgpack",
    "application/xml",
    "application/yaml",
    "text/plain",
    "text/html",
    "application/octet-stream",
    "application/jsonl",
    "json",
    "*/*",
    " ",
    "\x00",
    "application/json\x00",
)

# A protocol-0 pickle that runs `os.system("echo pwned")` if anything ever unpickles it.
PICKLE_BOMB = b"cos\nsystem\n(S'echo pwned'\ntR."

NUMBER_LITERALS: tuple[str, ...] = (
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "inf",
    "nan",
    "1e400",
    "-1e400",
    "1.7976931348623159e308",
    "4.9e-325",
    "1" + "0" * 400,
    "-" + "9" * 5_000,
    "0x10",
    "01",
    "1.",
    ".5",
    "+1",
    "1_000",
)


def nested(depth: int, kind: str = "array") -> str:
    """JSON nested `depth` levels deep: arrays, objects, or a mix."""
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    return '[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2)


def order_json(order_id: object = "o-1", amount: object = 9.5, **extra: object) -> bytes:
    """An Order-shaped JSON object (its fields may be made wrong on purpose)."""
    fields: dict[str, object] = {"order_id": order_id, "amount": amount, **extra}
    return json.dumps(fields).encode()


class _Duplicate(Exception):
    """The JSON object has a key twice: decoders differ on which one wins."""


def _refuse_constant(literal: str) -> object:
    raise ValueError(f"non-standard JSON constant {literal}")


def _pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Duplicate
    return dict(pairs)


def surely_not_an_order(body: bytes) -> bool:
    """True when no JSON decoder may turn `body` into Order(order_id: str, amount: float).

    False means "it might": a decoder can disagree with the standard library on details
    (lone surrogates, duplicate keys, UTF-8 in fields it skips, very deep nesting).
    """
    if not body.strip(b" \t\n\r").startswith(b"{"):
        return True  # not a JSON object at all
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return False  # a decoder may skip the bad bytes inside a field it ignores
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_pairs)
    except json.JSONDecodeError:
        return True
    except (_Duplicate, RecursionError):
        return False
    except ValueError as error:
        return "non-standard JSON constant" in str(error)  # else e.g. a 5,000-digit integer
    if not isinstance(value, dict):
        return True
    order_id, amount = value.get("order_id"), value.get("amount")
    if not isinstance(order_id, str) or isinstance(amount, bool):
        return True
    if isinstance(amount, float):
        return not math.isfinite(amount)
    return not isinstance(amount, int)  # a big integer may or may not fit a float


def canaries_imported() -> list[str]:
    """The canary modules that are imported now."""
    return [name for name in CANARY_MODULES if name in sys.modules]
