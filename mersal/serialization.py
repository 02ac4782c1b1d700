"""Codecs that turn message objects into bytes and back: JSON by default."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from mersal.errors import DecodeError


class Codec(Protocol):
    """Encodes message objects to bytes and decodes bytes into a given class."""

    content_type: str

    def encode(self, message: object) -> bytes:
        """The message as bytes."""
        ...

    def decode(self, body: bytes, cls: type) -> Any:
        """An instance of `cls` from bytes, or a `DecodeError` saying what is wrong."""
        ...


class JsonCodec:
    """JSON for dataclasses, msgspec Structs and pydantic models, validated against the class."""

    content_type = "application/json"

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder(enc_hook=_to_builtins)
        self._decoders: dict[type, msgspec.json.Decoder[Any]] = {}

    def encode(self, message: object) -> bytes:
        """The message as compact UTF-8 JSON."""
        return self._encoder.encode(message)

    def decode(self, body: bytes, cls: type) -> Any:
        """An instance of `cls` validated from a JSON body."""
        validate = getattr(cls, "model_validate_json", None)
        if validate is not None:
            return _decode_pydantic(validate, body, cls)
        decoder = self._decoders.get(cls)
        if decoder is None:
            decoder = self._decoders[cls] = msgspec.json.Decoder(cls)
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as error:
            raise DecodeError(f"body does not match {cls.__qualname__}: {error}") from None
        except msgspec.DecodeError as error:
            raise DecodeError(f"body is not valid JSON for {cls.__qualname__}: {error}") from None


def _to_builtins(value: object) -> Any:
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json", by_alias=True)
    raise NotImplementedError(f"cannot encode {type(value).__qualname__} as JSON")


def _decode_pydantic(validate: Any, body: bytes, cls: type) -> Any:
    try:
        return validate(body)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        reason = str(error).replace("\n", "; ")
        raise DecodeError(f"body does not match {cls.__qualname__}: {reason}") from None
