"""A fuzz target for the decode step: any bytes and headers in, only DecodeError out.

    python -m tests.fuzz.fuzz_decode --iterations 100000 [--seed 7]    # a plain random loop
    python -m tests.fuzz.fuzz_decode --atheris [libFuzzer options]     # needs `pip install atheris`

Each input is one byte string that `delivery_from` reads as choices (type name, content type,
extra headers, kind of body) followed by payload bytes, so plain random bytes reach every
branch: registered and hostile type names, wrong content types, the size cap, JSON templates
with odd values, deep nesting. The decode step runs on its own, without a transport; it must
either hand a message of a registered class to the next step or raise DecodeError. Any other
exception is a crash, and so is an import of any module on the way.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pydantic

from mersal import App, DecodeError, Envelope, Header, MessageContext, message
from mersal.pipeline import decode_step
from mersal.transaction import Transaction
from tests.fuzz.corpus import (
    CONTENT_TYPES,
    HOSTILE_NAMES,
    NUMBER_LITERALS,
    canaries_imported,
    nested,
)

CAP = 16_384
JSON = "application/json"


@dataclass
class Line:
    sku: str
    quantity: int


@message("fuzz.target.Order.v1")
@dataclass
class Order:
    order_id: str
    amount: float
    lines: list[Line] = field(default_factory=list)


@message("fuzz.target.Quote.v1")
class Quote(msgspec.Struct):
    item: str
    prices: dict[str, float]


@message("fuzz.target.Refund.v1")
class Refund(pydantic.BaseModel):
    order_id: str
    reason: str | None = None


ALLOWED: dict[str, type] = {
    "fuzz.target.Order.v1": Order,
    "fuzz.target.Quote.v1": Quote,
    "fuzz.target.Refund.v1": Refund,
}
HEADER_NAMES = tuple(
    value for name, value in vars(Header).items() if not name.startswith("_") and value != "type"
)
TEMPLATES = (
    b'{"order_id": "%s", "amount": %s}',
    b'{"order_id": "o-1", "amount": 1, "lines": [{"sku": "%s", "quantity": %s}]}',
    b'{"item": "%s", "prices": {"eur": %s}}',
    b'{"order_id": "%s", "reason": %s}',
    b'{"order_id": "o-1", "amount": 1, "extra": %s%s}',
)


class _Reader:
    """Reads choices and payloads from the front of one fuzz input; zeros once it runs out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        value = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return value

    def number(self) -> int:
        return self.byte() << 8 | self.byte()

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.byte() % len(options)]

    def chunk(self) -> bytes:
        size = self.byte()
        piece = self.data[self.at : self.at + size]
        self.at += size
        return piece

    def text(self) -> str:
        return self.chunk().decode("utf-8", "surrogateescape")

    def rest(self) -> bytes:
        return self.data[self.at :]


def delivery_from(data: bytes) -> tuple[dict[str, str], bytes]:
    """The headers and body one fuzz input stands for."""
    reader = _Reader(data)
    headers: dict[str, str] = {}
    kind = reader.byte() % 6
    if kind == 1:
        headers[Header.TYPE] = reader.pick(list(ALLOWED))
    elif kind == 2:
        headers[Header.TYPE] = reader.pick(HOSTILE_NAMES)
    elif kind == 3:
        headers[Header.TYPE] = reader.text()
    elif kind == 4:
        headers[Header.TYPE] = ("a." * reader.number())[:-1]
    elif kind == 5:
        headers[Header.TYPE] = reader.pick(list(ALLOWED)) + reader.text()
    content = reader.byte() % 4
    if content == 1:
        headers[Header.CONTENT_TYPE] = JSON
    elif content == 2:
        headers[Header.CONTENT_TYPE] = reader.pick(CONTENT_TYPES)
    elif content == 3:
        headers[Header.CONTENT_TYPE] = reader.text()
    for _ in range(reader.byte() % 8):
        name = reader.pick(HEADER_NAMES) if reader.byte() % 2 else reader.text()
        headers[name] = reader.text() if reader.byte() % 4 else "v" * reader.number() * 4
    return headers, _body(reader)


def _body(reader: _Reader) -> bytes:
    mode = reader.byte() % 5
    if mode == 1:
        template = reader.pick(TEMPLATES)
        value = reader.pick(NUMBER_LITERALS).encode() if reader.byte() % 2 else reader.chunk()
        return bytes(template % (reader.chunk().replace(b'"', b""), value))
    if mode == 2:
        depth = reader.number() % (CAP // 2)
        inner = nested(depth, reader.pick(("array", "object", "mixed"))).encode()
        return b'{"order_id": "o-1", "amount": 1, "x": %s}' % inner if reader.byte() % 2 else inner
    if mode == 3:  # one byte under the cap, at it, or one over
        size = CAP - 1 + reader.byte() % 3
        rest = reader.rest() or b" "
        return (rest * (size // len(rest) + 1))[:size]
    if mode == 4:
        literal: str = reader.pick(NUMBER_LITERALS)
        return literal.encode()
    return reader.rest()


class _Delivery:
    """A delivery that no broker holds: the decode step only reads its envelope."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.queue = "fuzz-target"
        self.redelivered = False

    async def ack(self) -> None:
        """Nothing to acknowledge."""

    async def nack(self, requeue: bool = True) -> None:
        """Nothing to return."""


def _transaction(envelope: Envelope) -> Transaction:
    """The decode step commits nothing: a transaction that refuses to."""
    return Transaction(_refuse)


async def _refuse(transaction: Transaction) -> None:
    raise AssertionError("the decode step committed a transaction")


class Target:
    """The decode step of an app with three registered types, and an input to check."""

    def __init__(self) -> None:
        self.app = App("fuzz-target", transport="memory://fuzz-target", max_body_size=CAP)
        for cls in ALLOWED.values():
            self.app.types.add(cls)
        self.decode = decode_step(self.app.codec, self.app.types, CAP)
        self.loop = asyncio.new_event_loop()
        self.passed = 0
        self.refused = 0
        self.modules = len(sys.modules)

    def check(self, data: bytes) -> None:
        """Decode one input: pass a registered message on or raise DecodeError, nothing else."""
        headers, body = delivery_from(data)
        context = MessageContext(self.app, _Delivery(Envelope(headers, body)), _transaction)
        reached: list[object] = []

        async def next_step(passed: MessageContext) -> None:
            reached.append(passed.message)

        try:
            self.loop.run_until_complete(self.decode(context, next_step))
        except DecodeError:
            self.refused += 1
        else:
            self.passed += 1
            assert reached, "the decode step neither passed the message on nor raised"
            assert len(body) <= CAP, f"a body of {len(body)} bytes passed the {CAP}-byte cap"
            name = headers.get(Header.TYPE, "")
            assert type(reached[0]) is ALLOWED.get(name), f"{name!r} decoded as {reached[0]!r}"
        if len(sys.modules) != self.modules:
            raise AssertionError(f"decoding imported a module; canaries: {canaries_imported()}")

    def warm_up(self, check: Callable[[bytes], None] | None = None) -> None:
        """Check the seed inputs, so that first-use imports happen before counting modules."""
        for data in seed_inputs():
            (check or self.check)(data)
        self.modules = len(sys.modules)
        self.passed = self.refused = 0

    def close(self) -> None:
        """Close the event loop."""
        self.loop.close()


def seed_inputs() -> list[bytes]:
    """Inputs that reach every type name, content type and kind of body at least once."""
    order = b'{"order_id": "o-1", "amount": 9.5, "lines": [{"sku": "s", "quantity": 2}]}'
    seeds = [
        bytes([1, 0, 1, 0, 0]) + order,
        bytes([1, 1, 1, 0, 0]) + b'{"item": "x", "prices": {"eur": 1.5}}',
        bytes([1, 2, 0, 0, 0]) + b'{"order_id": "o-1", "reason": null}',
        bytes([0, 1, 0, 0]) + order,  # no type header
        bytes([3, 0, 1, 0, 0]) + order,  # an empty type name
        bytes([4, 0x40, 0, 1, 0, 0]) + order,  # a 32 KiB type name
        bytes([5, 0, 2, ord("x"), ord("2"), 1, 0, 0]) + order,  # a registered name, extended
        bytes([1, 0, 1, 3, 1, 9, 1, 3, 0, 0x10, 0x3F, 0, 1, 4, 0]) + order,  # extra headers
        bytes([1, 0, 1, 0, 3]) + order,  # over the cap
    ]
    seeds += [bytes([2, index, 1, 0, 0]) + order for index in range(len(HOSTILE_NAMES))]
    seeds += [bytes([1, 0, 2, index, 0, 0]) + order for index in range(len(CONTENT_TYPES))]
    for template in range(len(TEMPLATES)):
        for literal in range(len(NUMBER_LITERALS)):
            seeds.append(bytes([1, template % 3, 1, 0, 1, template, 1, literal, 3]) + b"o-1")
    for depth in (10, 900, 1_000, 5_000, 8_000):
        for shape in range(3):
            for wrapped in (0, 1):
                seeds.append(bytes([1, 0, 1, 0, 2, depth >> 8, depth & 0xFF, shape, wrapped]))
    return seeds


def fuzz(iterations: int, seed: int, report: Callable[[str], None] = print) -> Target:
    """Check the seed inputs, then `iterations` random ones; raises on the first crash."""
    target = Target()

    def check(data: bytes) -> None:
        try:
            target.check(data)
        except Exception:
            report(f"crash on input {_describe(data)}")
            raise

    rng = random.Random(seed)
    seeds = seed_inputs()
    try:
        target.warm_up(check)
        for _ in range(iterations):
            check(_random_input(rng, seeds))
    finally:
        target.close()
    report(f"{iterations} inputs: {target.passed} decoded, {target.refused} refused, no crash")
    return target


def _random_input(rng: random.Random, seeds: list[bytes]) -> bytes:
    roll = rng.random()
    if roll < 0.3:  # bytes, choices and all
        return rng.randbytes(rng.choice((4, 16, 64, 256, 2_048)))
    if roll < 0.6:  # the choices of a seed, then random bytes
        return rng.choice(seeds)[: rng.randrange(1, 16)] + rng.randbytes(rng.randrange(300))
    data = bytearray(rng.choice(seeds))  # a seed with a few bytes changed, added or dropped
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data) + 1)
        change = rng.randrange(3)
        if change == 0 and at < len(data):
            data[at] = rng.randrange(256)
        elif change == 1:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            del data[at : at + rng.randint(1, 8)]
    return bytes(data)


def _describe(data: bytes) -> str:
    if len(data) <= 4_096:
        return f"bytes.fromhex({data.hex()!r})"
    with tempfile.NamedTemporaryFile(prefix="fuzz-decode-", suffix=".bin", delete=False) as file:
        file.write(data)
    return f"saved to {file.name}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plain loop, or hand the target to atheris."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.fuzz_decode", description=__doc__)
    parser.add_argument("--iterations", type=int, default=10_000, help="random inputs to try")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--atheris", action="store_true", help="fuzz with atheris (libFuzzer)")
    args, rest = parser.parse_known_args(argv)
    if args.atheris:
        return _run_atheris(rest)
    if rest:
        parser.error(f"unknown arguments {rest} (libFuzzer options need --atheris)")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {seed}")
    fuzz(args.iterations, seed)
    return 0


def _run_atheris(libfuzzer_args: list[str]) -> int:
    try:
        import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        print("atheris is not installed: pip install atheris, or leave out --atheris")
        return 2
    atheris.instrument_all()
    target = Target()
    target.warm_up()
    atheris.Setup([sys.argv[0], *libfuzzer_args], target.check)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
