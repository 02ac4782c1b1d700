"""Round trips per second of the candidate JSON codecs on a small dataclass message.

Justifies the default codec: msgspec validates while decoding and is still the fastest;
stdlib json and orjson are timed without validation (the class is built from the dict as is),
pydantic with validation.

Also what a send pays to encode: CPU µs per message for msgspec's bare encoder (the baseline),
`JsonCodec.encode`, and `encode` with `validate` (the body decoded back as the class, as every
send does), for a small dataclass, a nested one (20 lines) and a pydantic model.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bench.support import per_call_us
from mersal.serialization import JsonCodec

ROUNDTRIPS = 50_000
ENCODES = 20_000

Roundtrip = Callable[["Quote"], "Quote"]


@dataclass
class Quote:
    """A small message with the usual field types."""

    symbol: str
    quantity: int
    price: float
    firm: bool
    tags: list[str] = field(default_factory=list)


@dataclass
class Basket:
    """A nested message: an id and twenty quotes."""

    basket_id: str
    quotes: list[Quote]


SAMPLE = Quote("MRSL", 120, 19.75, True, ["retail", "limit", "day"])


async def run() -> dict[str, float | int]:
    """Time every importable codec on the same message."""
    figures: dict[str, float | int] = {}
    for name, roundtrip in codecs().items():
        if roundtrip(SAMPLE) != SAMPLE:
            raise AssertionError(f"codec {name} does not round-trip {SAMPLE!r}")
        figures[f"codec_{name}_roundtrips_per_s"] = ROUNDTRIPS / timed(roundtrip, ROUNDTRIPS)
    figures.update(send_encoding_costs())
    return figures


def send_encoding_costs() -> dict[str, float]:
    """CPU µs per message to encode a send: bare msgspec, `JsonCodec.encode`, with `validate`."""
    codec = JsonCodec()
    bare = msgspec.json.Encoder(enc_hook=lambda value: value.model_dump(mode="json"))
    figures: dict[str, float] = {}
    for kind, message in samples().items():
        codec.validate(message, codec.encode(message))  # every sample must pass

        def checked(message: object = message) -> None:
            codec.validate(message, codec.encode(message))

        for how, call in (("raw", bare.encode), ("codec", codec.encode), ("checked", checked)):
            figures[f"encode_{kind}_{how}_us"] = per_call_us(call, message, ENCODES)
        figures[f"encode_{kind}_check_us"] = (
            figures[f"encode_{kind}_checked_us"] - figures[f"encode_{kind}_codec_us"]
        )
    return figures


def samples() -> dict[str, object]:
    """The messages the encoding cost is measured on, by kind."""
    found: dict[str, object] = {
        "small": SAMPLE,
        "nested": Basket(
            "b-1", [Quote(f"S{n}", n, n + 0.5, n % 2 == 0, ["day"]) for n in range(20)]
        ),
    }
    if importlib.util.find_spec("pydantic") is not None:
        from pydantic import BaseModel

        class QuoteModel(BaseModel):
            symbol: str
            quantity: int
            price: float
            firm: bool
            tags: list[str] = []

        found["pydantic"] = QuoteModel(**dataclasses.asdict(SAMPLE))
    return found


def timed(roundtrip: Roundtrip, count: int) -> float:
    """Seconds for `count` encode+decode round trips of the sample, after a short warm-up."""
    sample = SAMPLE
    for _ in range(count // 50):
        roundtrip(sample)
    started = time.perf_counter()
    for _ in range(count):
        roundtrip(sample)
    return time.perf_counter() - started


def codecs() -> dict[str, Roundtrip]:
    """Each codec's encode+decode as one call; codecs whose library is missing are left out."""
    found: dict[str, Roundtrip] = {
        "msgspec": msgspec_roundtrip(),
        "stdlib_json": stdlib_roundtrip(),
    }
    orjson = optional("orjson")
    if orjson is not None:
        found["orjson"] = orjson_roundtrip(orjson)
    if importlib.util.find_spec("pydantic") is not None:
        found["pydantic"] = pydantic_roundtrip()
    return found


def optional(module: str) -> Any:
    """The module if it can be imported, else None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def msgspec_roundtrip() -> Roundtrip:
    """msgspec's JSON Encoder and a Decoder bound to the class: decoding validates."""
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(Quote)

    def roundtrip(message: Quote) -> Quote:
        return decoder.decode(encoder.encode(message))

    return roundtrip


def stdlib_roundtrip() -> Roundtrip:
    """json.dumps of dataclasses.asdict, then the class from json.loads: no validation."""
    dumps, loads, asdict = json.dumps, json.loads, dataclasses.asdict

    def roundtrip(message: Quote) -> Quote:
        body = dumps(asdict(message), separators=(",", ":")).encode()
        return Quote(**loads(body))

    return roundtrip


def orjson_roundtrip(orjson: Any) -> Roundtrip:
    """orjson (which encodes dataclasses natively), then the class from the dict: no validation."""
    dumps, loads = orjson.dumps, orjson.loads

    def roundtrip(message: Quote) -> Quote:
        return Quote(**loads(dumps(message)))

    return roundtrip


def pydantic_roundtrip() -> Roundtrip:
    """pydantic's TypeAdapter for the dataclass: dump_json, then validate_json."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(Quote)
    dump, validate = adapter.dump_json, adapter.validate_json

    def roundtrip(message: Quote) -> Quote:
        return validate(dump(message))

    return roundtrip
