"""What a saga's stored data survives: two releases of its class, a method's bad value, reads.

Two releases of one app run side by side while a deploy rolls: release 2 adds a field (with a
default) that release 1 does not know. Both share the sagas, in a database or, without one, in
one process's memory; each phase below is an app of one release on the same broker and store.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import zoneinfo
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import msgspec
import pydantic
import pytest
from lagom import Container
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, RetryPolicy
from mersal.sagas import MemorySagaStore, Saga
from mersal.testing import Harness
from tests.conftest import a_database

NAME = "tests.data.Account"
QUEUE = "accounts"


@dataclass
class Open:
    key: str


@dataclass
class Deposit:
    key: str
    amount: float


@dataclass
class Label:
    """Release 2's message: it sets the field release 1 does not know."""

    key: str
    label: str


@dataclass
class Spoil:
    """Release 1's method adds the amount as it is: a float in an int field."""

    key: str
    amount: float


@dataclass
class Peek:
    key: str


@dataclass
class Release1:
    key: str = ""
    balance: int = 0


@dataclass
class Release2:
    key: str = ""
    balance: int = 0
    label: str = "none"
    tags: list[str] = field(default_factory=list)


class Account1(Saga[Release1], name=NAME):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key", Spoil: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def deposit(self, message: Deposit) -> None:
        self.data.balance += int(message.amount)

    async def spoil(self, message: Spoil) -> None:
        self.data.balance += message.amount  # type: ignore[assignment]  # a float, on purpose


class Account2(Saga[Release2], name=NAME):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key", Label: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def deposit(self, message: Deposit) -> None:
        self.data.balance += int(message.amount)

    async def label(self, message: Label) -> None:
        self.data.label = message.label
        self.data.tags.append(message.label)


@dataclass
class Seen:
    """What the Peek handler read with `app.saga_data`, and how long it took."""

    data: list[object] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def account_app(saga: type[Saga[object]], database: str | None, seen: Seen | None = None) -> App:
    container = Container()
    container[Seen] = seen or Seen()
    app = App(
        QUEUE,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{QUEUE}.error"),
        handler_timeout=5,
        container=container,
    )
    app.register_saga(saga)
    for message_type in (Open, Deposit, Label, Spoil, Peek):
        app.route(message_type, QUEUE)
    return app


Phase = Callable[[type[Saga[object]]], App]


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgresql", marks=pytest.mark.integration)]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str | None]:
    """Where the sagas are kept: one process's memory (None), or a database of the test's own."""
    if request.param == "memory":
        yield None
        return
    async with a_database(request.param, tmp_path, tables="app") as url:
        yield url


def phases(database: str | None) -> Phase:
    """Apps of either release on one store: the database, or one shared memory store."""
    memory = MemorySagaStore()

    def app_of(saga: type[Saga[object]]) -> App:
        app = account_app(saga, database)
        if database is None:
            app.sagas.memory = memory  # two releases in one process: one memory store
        return app

    return app_of


async def run(app: App, *messages: object) -> Harness:
    """Send `messages` to `app`, one at a time, each handled before the next."""
    async with Harness(app) as bus:
        for message in messages:
            await app.send(message)
            await bus.idle()
    return bus


async def read(app: App, saga: type[Saga[object]], key: str) -> object:
    async with Harness(app) as bus:
        return await bus.saga_data(saga, key)


async def test_a_newer_releases_field_survives_an_older_release(store: str | None) -> None:
    app_of = phases(store)
    bus = await run(app_of(Account2), Open("a-1"), Label("a-1", "gold"))
    assert bus.dead_lettered == []

    bus = await run(app_of(Account1), Deposit("a-1", 5))  # release 1 loads and saves
    assert bus.dead_lettered == []

    assert await read(app_of(Account2), Account2, "a-1") == Release2(
        "a-1", balance=5, label="gold", tags=["gold"]
    )
    bus = await run(app_of(Account2), Deposit("a-1", 1))
    assert await read(app_of(Account1), Account1, "a-1") == Release1("a-1", balance=6)


async def test_a_method_storing_what_its_class_cannot_read_fails_itself(
    store: str | None,
) -> None:
    app_of = phases(store)
    assert (await run(app_of(Account1), Open("a-1"))).dead_lettered == []

    bus = await run(app_of(Account1), Spoil("a-1", 2.5), Spoil("a-1", 2.0))

    first, second = bus.dead_lettered
    for dead, amount in ((first, 2.5), (second, 2.0)):
        assert dead.error_type == "mersal.errors.MersalError"
        assert dead.error_message == (
            "Account1.spoil() left data in saga 'tests.data.Account' that would not load back "
            f"as Release1, so nothing was saved: field balance holds a float ({amount}) where "
            "Release1 declares int; store values of the fields' declared types"
        )
    assert await read(app_of(Account1), Account1, "a-1") == Release1("a-1")
    bus = await run(app_of(Account2), Deposit("a-1", 3.0))  # the saga is not poisoned
    assert bus.dead_lettered == []
    assert await read(app_of(Account1), Account1, "a-1") == Release1("a-1", balance=3)


class Peeker:
    """A handler that uses the message's session, then reads a saga's data."""

    def __init__(self, app: App, session: AsyncSession, seen: Seen) -> None:
        self.app = app
        self.session = session
        self.seen = seen

    async def __call__(self, message: Peek) -> None:
        await self.session.execute(text("SELECT 1"))  # the message now holds a connection
        began = time.monotonic()
        self.seen.data.append(await self.app.saga_data(Account2, message.key))
        self.seen.seconds.append(time.monotonic() - began)


async def test_saga_data_in_a_handler_reads_through_the_messages_transaction(
    database: str,
) -> None:
    """On SQLite the message holds the one pooled connection: a read elsewhere would wait."""
    seen = Seen()
    app = account_app(Account2, database, seen)
    app.register(Peek, Peeker)
    async with Harness(app) as bus:
        for message in (Open("a-1"), Label("a-1", "gold"), Peek("a-1"), Peek("a-2")):
            await app.send(message)
            await bus.idle(timeout=10)

    assert bus.dead_lettered == []
    assert seen.data == [Release2("a-1", label="gold", tags=["gold"]), None]
    assert max(seen.seconds) < 1


async def test_saga_data_in_an_app_transaction_reads_through_its_session(database: str) -> None:
    """On SQLite the block's session holds the one pooled connection: a read elsewhere waits."""
    app = account_app(Account2, database)
    async with Harness(app) as bus:
        await app.send(Open("a-1"))
        await bus.idle(timeout=10)
        async with app.transaction() as transaction:
            assert isinstance(transaction.session, AsyncSession)
            await transaction.session.execute(text("SELECT 1"))  # it holds a connection now
            await app.send(Open("a-2"))  # and writes an outbox row
            data = await asyncio.wait_for(app.saga_data(Account2, "a-1"), 5)
            assert await asyncio.wait_for(app.saga_data(Account2, "a-3"), 5) is None
        await bus.idle(timeout=10)

        assert data == Release2("a-1")
        assert await bus.saga_data(Account2, "a-2") == Release2("a-2")
    assert bus.dead_lettered == []


class Follower:
    """A handler of the saga's own messages: it reads the data after the saga's method ran."""

    def __init__(self, app: App, seen: Seen) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, message: Open | Label) -> None:
        self.seen.data.append(await self.app.saga_data(Account2, message.key))


async def test_saga_data_in_a_handler_sees_what_its_message_wrote(store: str | None) -> None:
    seen = Seen()
    app = account_app(Account2, store, seen)
    app.register(Open, Follower)
    app.register(Label, Follower)
    async with Harness(app) as bus:
        for message in (Open("a-1"), Label("a-1", "gold")):
            await app.send(message)
            await bus.idle(timeout=10)

    assert bus.dead_lettered == []
    assert seen.data == [Release2("a-1"), Release2("a-1", label="gold", tags=["gold"])]


class Gatherer:
    """A handler that reads several sagas' data at once."""

    def __init__(self, app: App, seen: Seen) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, message: Peek) -> None:
        keys = message.key.split(",")
        self.seen.data.append(
            await asyncio.gather(*(self.app.saga_data(Account2, key) for key in keys))
        )


async def test_saga_data_read_concurrently_in_a_handler_takes_turns_in_its_session(
    database: str,
) -> None:
    seen = Seen()
    app = account_app(Account2, database, seen)
    app.register(Peek, Gatherer)
    async with Harness(app) as bus:
        for key in ("a-1", "a-2", "a-3"):
            await app.send(Open(key))
        await bus.idle(timeout=10)
        await app.send(Peek("a-1,a-2,a-9,a-3"))
        await bus.idle(timeout=10)
        await app.send(Open("a-4"))  # the app goes on: the message's session ended cleanly
        await bus.idle(timeout=10)

        assert await bus.saga_data(Account2, "a-4") == Release2("a-4")
    assert bus.dead_lettered == []
    assert seen.data == [[Release2("a-1"), Release2("a-2"), None, Release2("a-3")]]


class Strict1(msgspec.Struct, forbid_unknown_fields=True):
    key: str = ""
    balance: int = 0


class Strict2(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    key: str = ""
    balance: int = 0
    risk_level: str = "low"


class StrictAccount1(Saga[Strict1], name="tests.data.StrictAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def deposit(self, message: Deposit) -> None:
        self.data.balance += int(message.amount)


class StrictAccount2(Saga[Strict2], name="tests.data.StrictAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Label: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def label(self, message: Label) -> None:
        self.data.risk_level = message.label


async def test_unknown_keys_are_no_error_for_a_class_that_forbids_them() -> None:
    """A Struct with forbid_unknown_fields (and renamed fields) still loads a newer row."""
    app_of = phases(None)
    bus = await run(app_of(StrictAccount2), Open("a-1"), Label("a-1", "high"))
    assert bus.dead_lettered == []
    bus = await run(app_of(StrictAccount1), Deposit("a-1", 4))
    assert bus.dead_lettered == []
    assert await read(app_of(StrictAccount2), StrictAccount2, "a-1") == Strict2(
        "a-1", balance=4, risk_level="high"
    )


# Inside the data: what release 1 cannot keep, it refuses to save rather than erase.


@dataclass
class Address1:
    city: str = ""


@dataclass
class Address2:
    city: str = ""
    zip: str = ""


@dataclass
class Nested1:
    key: str = ""
    balance: int = 0
    addr: Address1 = field(default_factory=Address1)
    previous: list[Address1] | None = None


@dataclass
class Nested2:
    key: str = ""
    balance: int = 0
    addr: Address2 = field(default_factory=Address2)
    previous: list[Address2] | None = None


class Array1(msgspec.Struct, array_like=True):
    key: str = ""
    balance: int = 0


class Array2(msgspec.Struct, array_like=True):
    key: str = ""
    balance: int = 0
    label: str = "none"


def nested_label(data: Nested2, label: str) -> None:
    data.addr.zip = label


def previous_label(data: Nested2, label: str) -> None:
    data.previous = [Address2("old"), Address2("older", zip=label)]


def array_label(data: Array2, label: str) -> None:
    data.label = label


class Card1(pydantic.BaseModel):
    kind: Literal["card"] = "card"
    number: str = ""


class Bank(pydantic.BaseModel):
    kind: Literal["bank"] = "bank"
    iban: str = ""


class Card2(Card1):
    expiry: str = ""


class Paid1(pydantic.BaseModel):
    key: str = ""
    balance: int = 0
    pay: Card1 | Bank = pydantic.Field(default_factory=Bank)


class Paid2(pydantic.BaseModel):
    key: str = ""
    balance: int = 0
    pay: Card2 | Bank = pydantic.Field(default_factory=Bank)


class TaggedCard1(msgspec.Struct, tag="card"):
    number: str = ""


class TaggedBank(msgspec.Struct, tag="bank"):
    iban: str = ""


class TaggedCard2(msgspec.Struct, tag="card"):
    number: str = ""
    expiry: str = ""


class Tagged1(msgspec.Struct):
    key: str = ""
    balance: int = 0
    pay: TaggedCard1 | TaggedBank = msgspec.field(default_factory=TaggedBank)


class Tagged2(msgspec.Struct):
    key: str = ""
    balance: int = 0
    pay: TaggedCard2 | TaggedBank = msgspec.field(default_factory=TaggedBank)


@dataclass
class Pair1:
    key: str = ""
    balance: int = 0
    pair: tuple[Address1, int] = (Address1(), 0)


@dataclass
class Pair2:
    key: str = ""
    balance: int = 0
    pair: tuple[Address2, int] = (Address2(), 0)


def card_label(data: Paid2, label: str) -> None:
    data.pay = Card2(number="4111", expiry=label)


def tagged_card_label(data: Tagged2, label: str) -> None:
    data.pay = TaggedCard2("4111", expiry=label)


def pair_label(data: Pair2, label: str) -> None:
    data.pair = (Address2("x", zip=label), 1)


def releases(
    name: str, old: type, new: type, set_label: Callable[[Any, str], None]
) -> tuple[type[Saga[object]], type[Saga[object]]]:
    """Release 1 and 2 of a saga whose data class is `old`, then `new`."""

    class Old(Saga[old], name=name):  # type: ignore[valid-type]
        started_by = (Open,)
        correlation = {Open: "key", Deposit: "key"}

        async def open(self, message: Open) -> None:
            self.data.key = message.key

        async def deposit(self, message: Deposit) -> None:
            self.data.balance += int(message.amount)

    class New(Old, Saga[new], name=name):  # type: ignore[valid-type]
        correlation = {Open: "key", Deposit: "key", Label: "key"}

        async def label(self, message: Label) -> None:
            set_label(self.data, message.label)

    return Old, New


@pytest.mark.parametrize(
    ("old", "new", "set_label", "path"),
    [
        (Nested1, Nested2, nested_label, "'addr.zip'"),
        (Nested1, Nested2, previous_label, "'previous[1].zip'"),
        (Array1, Array2, array_label, "'[2]'"),
        (Paid1, Paid2, card_label, "'pay.expiry'"),
        (Tagged1, Tagged2, tagged_card_label, "'pay.expiry'"),
        (Pair1, Pair2, pair_label, "'pair[0].zip'"),
    ],
    ids=["nested", "list-of-nested", "array-like", "union", "tagged-union", "fixed-tuple"],
)
async def test_an_older_release_refuses_to_erase_what_a_newer_one_stored_inside_the_data(
    old: type, new: type, set_label: Callable[[Any, str], None], path: str
) -> None:
    Old, New = releases(f"tests.data.{new.__name__}", old, new, set_label)
    app_of = phases(None)
    bus = await run(app_of(New), Open("a-1"), Label("a-1", "gold"))
    assert bus.dead_lettered == []
    stored = await read(app_of(New), New, "a-1")

    bus = await run(app_of(Old), Deposit("a-1", 5))

    [dead] = bus.dead_lettered
    assert dead.error_type == "mersal.errors.MersalError"
    assert f"the stored data of {Old.__qualname__} saga " in dead.error_message
    assert path in dead.error_message
    assert f", which {old.__name__} of this release does not know" in dead.error_message
    assert "a newer release wrote it" in dead.error_message
    assert "Run the newer release for this saga, or add the field" in dead.error_message
    assert await read(app_of(New), New, "a-1") == stored
    bus = await run(app_of(New), Deposit("a-1", 5))  # the newer release goes on with it
    assert bus.dead_lettered == []


@pytest.mark.parametrize("data", [Paid1, Tagged1, Pair1])
async def test_data_in_a_union_or_a_fixed_tuple_that_its_class_knows_is_saved(data: type) -> None:
    Old, _ = releases(f"tests.data.{data.__name__}", data, data, lambda data, label: None)
    bus = await run(phases(None)(Old), Open("a-1"), Deposit("a-1", 5), Deposit("a-1", 1))

    assert bus.dead_lettered == []


class Sparse(msgspec.Struct, omit_defaults=True):
    key: str = ""
    balance: int = 0
    label: str = "none"


class SparseAccount(Saga[Sparse], name="tests.data.SparseAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Label: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def label(self, message: Label) -> None:
        self.data.label = message.label


async def test_a_field_set_back_to_its_default_stays_at_its_default() -> None:
    """With omit_defaults the field leaves the encoding: its stored value must not come back."""
    app_of = phases(None)
    bus = await run(app_of(SparseAccount), Open("a-1"), Label("a-1", "gold"), Label("a-1", "none"))

    assert bus.dead_lettered == []
    assert await read(app_of(SparseAccount), SparseAccount, "a-1") == Sparse("a-1")


class Renamed(pydantic.BaseModel):
    """Reads `amount` under its old name `balance` too (what earlier releases wrote)."""

    key: str = ""
    amount: int = pydantic.Field(0, validation_alias=pydantic.AliasChoices("amount", "balance"))
    history: list[int] = pydantic.Field(
        default_factory=list,
        validation_alias=pydantic.AliasChoices("history", pydantic.AliasPath("past", "history")),
    )


class RenamedAccount(Saga[Renamed], name="tests.data.RenamedAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def deposit(self, message: Deposit) -> None:
        self.data.amount += int(message.amount)
        self.data.history.append(int(message.amount))


async def test_a_field_read_under_an_older_alias_keeps_its_value() -> None:
    memory = MemorySagaStore()
    app = account_app(RenamedAccount, None)
    app.sagas.memory = memory
    await run(app, Open("a-1"))
    [row] = memory.rows.values()
    row.data = b'{"key":"a-1","balance":7,"past":{"history":[7]}}'  # an earlier release's row

    bus = await run(app, Deposit("a-1", 1))

    assert bus.dead_lettered == []
    assert await read(app, RenamedAccount, "a-1") == Renamed(key="a-1", amount=8, history=[7, 1])
    assert msgspec.json.decode(memory.rows[row_key(memory)].data or b"") == {
        "key": "a-1",
        "amount": 8,
        "history": [7, 1],
    }


def row_key(memory: MemorySagaStore) -> tuple[str, str]:
    [key] = memory.rows
    return key


class Loose(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    key: str = ""
    balance: int = 0


class LooseAccount(Saga[Loose], name="tests.data.LooseAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key", Label: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def label(self, message: Label) -> None:
        self.data.label = message.label  # type: ignore[attr-defined]  # an allowed extra

    async def deposit(self, message: Deposit) -> None:
        assert self.data.model_extra == {"label": "gold"}
        self.data.balance += int(message.amount)


async def test_the_extra_fields_of_a_model_that_allows_them_load_again() -> None:
    app_of = phases(None)
    bus = await run(app_of(LooseAccount), Open("a-1"), Label("a-1", "gold"), Deposit("a-1", 2))

    assert bus.dead_lettered == []
    loaded = await read(app_of(LooseAccount), LooseAccount, "a-1")
    assert loaded == Loose.model_validate({"key": "a-1", "balance": 2, "label": "gold"})


# Data that loads back as its class is saved, whatever its values load back as.

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
SECOND_HALF_HOUR = datetime.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=BERLIN)  # a DST fold


class Tidy(pydantic.BaseModel):
    """Fields whose values come back changed: normalised, excluded, NaN, a fold; computed."""

    model_config = pydantic.ConfigDict(extra="forbid")
    key: str = ""
    name: str = ""
    price: Decimal = pydantic.Field(default=Decimal(0), allow_inf_nan=True)
    when: datetime.datetime | None = None
    cache: dict[str, int] = pydantic.Field(default_factory=dict, exclude=True)

    @pydantic.field_validator("name")
    @classmethod
    def lower(cls, name: str) -> str:
        return name.strip().lower()

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def size(self) -> int:
        return len(self.name)


@dataclass
class Tidy_:
    key: str


class TidyAccount(Saga[Tidy], name="tests.data.TidyAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Tidy_: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def tidy_(self, message: Tidy_) -> None:
        self.data.name = " ABC "
        self.data.price = Decimal("NaN")
        self.data.when = SECOND_HALF_HOUR
        self.data.cache["hits"] = 1


async def test_data_that_loads_back_as_its_class_is_saved_whatever_its_values_load_back_as() -> (
    None
):
    app = account_app(TidyAccount, None)
    app.route(Tidy_, QUEUE)
    async with Harness(app) as bus:
        await app.send(Open("a-1"))
        await bus.idle()
        await app.send(Tidy_("a-1"))
        await bus.idle()

        assert bus.dead_lettered == []
        data = await bus.saga_data(TidyAccount, "a-1")
        assert isinstance(data, Tidy)
        assert (data.name, data.size, data.cache) == ("abc", 3, {})
        assert data.price.is_nan()
        assert data.when is not None
        assert data.when.timestamp() == SECOND_HALF_HOUR.timestamp()


# A pydantic model's computed fields are stored, and known to its class, at every level.


class Line(pydantic.BaseModel):
    quantity: int = 1

    @pydantic.computed_field(alias="lineTotal")  # type: ignore[prop-decorator]
    @property
    def total(self) -> int:
        return 2 * self.quantity


class Basket(pydantic.BaseModel):
    key: str = ""
    lines: list[Line] = []
    first: Line | None = None

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def count(self) -> int:
        return len(self.lines)


class BasketAccount(Saga[Basket], name="tests.data.BasketAccount"):
    started_by = (Open,)
    correlation = {Open: "key", Deposit: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key

    async def deposit(self, message: Deposit) -> None:
        self.data.lines.append(Line(quantity=int(message.amount)))
        self.data.first = self.data.lines[0]


async def test_computed_fields_inside_the_data_are_not_taken_for_a_newer_releases() -> None:
    app = account_app(BasketAccount, None)
    async with Harness(app) as bus:
        for message in (Open("a-1"), Deposit("a-1", 1), Deposit("a-1", 2), Deposit("a-1", 3)):
            await app.send(message)
            await bus.idle()

        assert bus.dead_lettered == []
        data = await bus.saga_data(BasketAccount, "a-1")
        assert isinstance(data, Basket)
        assert [line.total for line in data.lines] == [2, 4, 6]
        assert data.count == 3
