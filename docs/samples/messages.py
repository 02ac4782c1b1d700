"""Messages: dataclasses, msgspec Structs and pydantic models, named."""

from __future__ import annotations

# --8<-- [start:types]
from dataclasses import dataclass

import msgspec
from pydantic import BaseModel

from mersal import App, Header, message
from mersal.testing import Harness


@message("catalog.PriceChanged.v1")
@dataclass
class PriceChanged:
    sku: str
    price: float


@message("catalog.StockCounted.v1")
class StockCounted(msgspec.Struct):
    sku: str
    count: int


@message("catalog.NoteAdded.v1")
class NoteAdded(BaseModel):  # pydantic: pip install 'mersal-bus[pydantic]'
    sku: str
    text: str


# --8<-- [end:types]


# --8<-- [start:run]
async def main() -> tuple[list[object], list[str]]:
    app = App("catalog")
    received: list[object] = []

    async def record(message: object) -> None:
        received.append(message)

    for cls in (PriceChanged, StockCounted, NoteAdded):
        # also allows the type: only registered types decode
        app.register(cls, record)
        app.route(cls, "catalog")
    async with Harness(app) as bus:
        await app.send(PriceChanged("p-1", 9.5))
        await app.send(StockCounted("p-1", 12))
        await app.send(NoteAdded(sku="p-1", text="recount on Monday"))
        await bus.idle()
    # the wire names travel in the `type` header
    return received, [sent.headers[Header.TYPE] for sent in bus.sent]
    # --8<-- [end:run]
