"""Every intent ends once: a model of the bus under failures, copies, restarts and replays.

Hypothesis drives an app on a private memory broker and a SQLite file through a random mix of
steps: commands sent, deferred and published (each an *intent* with an id and an effect: a row,
or a counter raised, written through the message's AsyncSession; some send a child intent
through the outbox), handlers that fail (raise, cancel, or hang past `handler_timeout`) a few
times or always, copies of one message id, the app stopped while a handler is blocked or about
when hanging ones time out and a new app started on the same broker and database (the memory
transport returns a stopped app's unacknowledged deliveries to their queue), a saga's events,
completion and timeouts, and dead letters replayed (`mersal.dead_letters.DeadLetters`) once
their handler is fixed.

After every step the app must come to rest, and then every intent's effect happened exactly
once or the intent waits in the error queue with a reason, never both and never neither; and
every saga's data equals the model's. `make test` runs the same examples everywhere; `make
fuzz` (MERSAL_FUZZ=explore) explores new ones, ten times as many.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import tempfile
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from lagom import Container
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, Header, RetryPolicy, message
from mersal.dead_letters import DeadLetter, DeadLetters
from mersal.sagas import Saga
from mersal.transport.memory import MemoryTransport
from tests.fuzz.rig import EXPLORE

T = TypeVar("T")

POLICY = RetryPolicy(immediate=1, delayed=[0.02], error_queue="model.errors")
ATTEMPTS = POLICY.max_attempts
ALWAYS = 1_000_000
"""Failures left of a handler that never succeeds until it is fixed."""
HANDLER_TIMEOUT = 0.5
"""Seconds; a message's wait for SQLite's one connection counts too: room for a busy machine."""
GRACE = 0.05
LATER = 3_600.0
"""Seconds: a saga's timeout or a deferred message comes only when a step delivers it."""
SETTLE = 15.0
"""Seconds a step's messages may take to come to rest before the app counts as stuck."""
TALLIES = ("t-1", "t-2", "t-3")
MEMORY_DISK = "/dev/shm" if Path("/dev/shm").is_dir() else None
"""Where the SQLite file goes: commits that wait for no disk keep each message's wait for the
app's one SQLite connection (its handler time) far below the handler timeout on a busy machine."""

KINDS = ("raise", "raise", "raise", "cancel", "cancel", "hang")
"""How a failing attempt fails (hangs are slow: each waits out the handler timeout)."""
ERROR_TYPES = {"raise": "Boom", "cancel": "CancelledError", "hang": "HandlerTimeout"}
"""A fragment of the error type a dead letter of each kind must carry."""


class Boom(Exception):
    """What a failing handler raises."""


# Messages.


@message("model.Work.v1")
@dataclass
class Work:
    intent: str
    child: str = ""
    """An intent the handler sends on (through the outbox) after writing its effect."""


@message("model.Happened.v1")
@dataclass
class Happened:
    intent: str


@message("model.TallyOpened.v1")
@dataclass
class TallyOpened:
    tally: str
    intent: str


@message("model.TallyAdded.v1")
@dataclass
class TallyAdded:
    tally: str
    intent: str
    amount: int


@message("model.TallyClosed.v1")
@dataclass
class TallyClosed:
    tally: str
    intent: str
    report: str = ""
    """An intent the saga sends on (through the outbox) as it completes."""


@message("model.TallyExpired.v1")
@dataclass
class TallyExpired:
    tally: str


# What the handlers do: the world they share with the test.


@dataclass
class Plan:
    """How an intent's handler behaves, attempt by attempt."""

    fails: int = 0
    """Attempts left that fail (ALWAYS: until the test fixes it)."""
    kind: str = "raise"
    effect: str = "row"
    """"row": the effect is a row inserted; "counter": a counter raised by one."""
    block: bool = False
    """The next attempt waits after writing its effect until its app is stopped."""


@dataclass
class World:
    """The plans the handlers follow, shared by every app of one run."""

    plans: dict[str, Plan] = field(default_factory=dict)
    blocked: asyncio.Event | None = None

    async def before(self, intent: str) -> None:
        """Fail now if the plan says so by cancelling or hanging."""
        plan = self.plans[intent]
        if plan.fails and plan.kind in ("cancel", "hang"):
            plan.fails -= 1
            if plan.kind == "cancel":
                raise asyncio.CancelledError()
            await asyncio.sleep(3_600)  # cancelled at the handler timeout

    async def after(self, intent: str) -> None:
        """Block until stopped, or fail by raising, if the plan says so."""
        plan = self.plans[intent]
        if plan.block:
            plan.block = False
            assert self.blocked is not None
            self.blocked.set()
            await asyncio.sleep(3_600)  # cancelled when the app stops
        if plan.fails and plan.kind == "raise":
            plan.fails -= 1
            raise Boom(f"{intent} fails")


class Effect:
    """Writes an intent's effect through the message's session, sends its child, misbehaves."""

    def __init__(self, app: App, session: AsyncSession, world: World) -> None:
        self.app, self.session, self.world = app, session, world

    async def __call__(self, message: Work | Happened) -> None:
        intent = message.intent
        await self.world.before(intent)
        if self.world.plans[intent].effect == "row":
            statement = "INSERT INTO effects (intent) VALUES (:intent)"
        else:
            statement = (
                "INSERT INTO counters (intent, n) VALUES (:intent, 1) "
                "ON CONFLICT (intent) DO UPDATE SET n = n + 1"
            )
        await self.session.execute(text(statement), {"intent": intent})
        if isinstance(message, Work) and message.child:
            await self.app.send(Work(message.child))
        await self.world.after(intent)


@dataclass
class TallyData:
    tally: str = ""
    opens: int = 0
    count: int = 0
    total: int = 0
    expired: int = 0


class Tally(Saga[TallyData], name="model.Tally"):
    """Counts the amounts added to one tally until it is closed; expires once, an hour on."""

    started_by = (TallyOpened,)
    correlation = {TallyOpened: "tally", TallyAdded: "tally", TallyClosed: "tally"}

    def __init__(self, app: App, world: World) -> None:
        self.app, self.world = app, world

    async def opened(self, message: TallyOpened) -> None:
        await self.world.before(message.intent)
        if not self.data.opens:
            await self.request_timeout(LATER, TallyExpired(message.tally))
        self.data = replace(self.data, tally=message.tally, opens=self.data.opens + 1)
        await self.world.after(message.intent)

    async def added(self, message: TallyAdded) -> None:
        await self.world.before(message.intent)
        self.data.count += 1
        self.data.total += message.amount
        await self.world.after(message.intent)

    async def closed(self, message: TallyClosed) -> None:
        await self.world.before(message.intent)
        self.mark_complete()
        await self.app.send(Work(message.report))
        await self.world.after(message.intent)

    async def expired(self, message: TallyExpired) -> None:
        self.data.expired += 1


def build_app(name: str, broker: str, database: str, world: World) -> App:
    """An app on the memory broker `broker` and the database, following `world`'s plans."""
    container = Container()
    container[World] = world
    app = App(
        name,
        transport=broker,
        database=database,
        retry=POLICY,
        concurrency=4,
        handler_timeout=HANDLER_TIMEOUT,
        grace_period=GRACE,
        container=container,
    )
    app.register(Work, Effect)
    app.register(Happened, Effect)
    app.route(Work, name)
    app.subscribe(Happened)
    app.register_saga(Tally)
    app.route(TallyOpened, name)
    app.route(TallyAdded, name)
    app.route(TallyClosed, name)
    return app


def create_effect_tables(path: Path) -> None:
    """The tables the handlers write their effects to."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE effects (intent TEXT NOT NULL)")
        db.execute("CREATE TABLE counters (intent TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    db.close()


def effects_in(path: Path) -> Counter[str]:
    """How often each intent's effect happened, as committed."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT intent, COUNT(*) FROM effects GROUP BY intent").fetchall()
        counters = db.execute("SELECT intent, n FROM counters").fetchall()
    db.close()
    found: Counter[str] = Counter()
    for intent, n in [*rows, *counters]:
        found[intent] += n
    return found


# The model.


@dataclass
class Intent:
    """What the test sent for one intent, and what must have become of it."""

    message: Any
    message_id: str
    publish: bool
    kind: str
    effects: int = 0
    """How often its effect must be in the database (0 or 1; saga intents: always 0)."""
    dead: int = 0
    """How many copies of it must wait in the error queue."""
    saga: bool = False
    copies: int = 1
    waiting: bool = False
    """Deferred, and not delivered yet."""


@dataclass
class TallyModel:
    """A running saga as the model sees it."""

    generation: int
    data: TallyData


# Strategies.

failures = st.sampled_from([0, 0, 0, 1, 1, 2, ALWAYS])
kinds = st.sampled_from(KINDS)
effects = st.sampled_from(["row", "counter"])


@st.composite
def work(draw: st.DrawFn) -> dict[str, Any]:
    """One plain intent: how it is sent, how its handler behaves, how many copies go."""
    return {
        "fails": draw(failures),
        "kind": draw(kinds),
        "effect": draw(effects),
        "publish": draw(st.booleans()),
        "copies": draw(st.sampled_from([1, 1, 1, 2])),
        "child": draw(st.sampled_from([False, False, True])),
        "later": draw(st.sampled_from([False, False, False, True])),
    }


class BusModel(RuleBasedStateMachine):
    """One app (restarted now and then) on a memory broker and a SQLite file, against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = Path(tempfile.mkdtemp(prefix="mersal-bus-model-", dir=MEMORY_DISK))
        self.path = self.directory / "bus.db"
        create_effect_tables(self.path)
        self.database = f"sqlite+aiosqlite:///{self.path}"
        self.name = f"model-{uuid.uuid4().hex[:8]}"
        self.broker = f"memory://{self.name}"
        self.world = World()
        self.app: App | None = None
        self.lives = 0
        self.intents: dict[str, Intent] = {}
        self.tallies: dict[str, TallyModel | None] = {}
        self.timeouts: list[tuple[str, int]] = []
        """(tally, generation) of each requested timeout not yet delivered."""
        self.generations = 0
        self.counter = 0

    # Running.

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the machine's loop."""
        return self.loop.run_until_complete(coroutine)

    @initialize()
    def start(self) -> None:
        """The first app."""
        self.run(self._start())

    async def _start(self) -> None:
        self.world.blocked = asyncio.Event()
        self.app = build_app(self.name, self.broker, self.database, self.world)
        self.lives += 1
        await self.app.start()

    def teardown(self) -> None:
        """Stop the app, close the loop, remove the database."""
        try:
            if self.app is not None:
                self.run(self.app.stop())
        finally:
            self.loop.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def running(self) -> App:
        """The app of this life."""
        assert self.app is not None
        return self.app

    def new_id(self, prefix: str) -> str:
        """A fresh intent id."""
        self.counter += 1
        return f"{prefix}-{self.counter}"

    async def _send(self, intent: Intent) -> None:
        app = self.running
        headers = {Header.MESSAGE_ID: intent.message_id}
        if intent.publish:
            await app.publish(intent.message, headers=headers)
        elif intent.waiting:
            await app.defer(LATER, intent.message, headers=headers)
        else:
            await app.send(intent.message, headers=headers)

    def plain(self, spec: dict[str, Any]) -> Intent:
        """Register a plain intent (and its child) in the world and the model."""
        intent_id = self.new_id("i")
        child = self.child() if spec["child"] and not spec["publish"] else ""
        self.world.plans[intent_id] = Plan(spec["fails"], spec["kind"], spec["effect"])
        message: Any = Happened(intent_id) if spec["publish"] else Work(intent_id, child)
        intent = Intent(message, uuid.uuid4().hex, spec["publish"], spec["kind"])
        intent.copies = spec["copies"]
        self.intents[intent_id] = intent
        if spec.get("later") and not spec["publish"]:
            intent.waiting = True
        else:
            self.arrived(intent)
        return intent

    def child(self) -> str:
        """A plain intent that a handler or a saga sends on; its handler succeeds at once."""
        intent_id = self.new_id("c")
        self.world.plans[intent_id] = Plan()
        self.intents[intent_id] = Intent(Work(intent_id), "", False, "raise")
        return intent_id

    def arrived(self, intent: Intent) -> None:
        """A plain intent reached its handler: handled in the end, or dead-lettered."""
        intent.waiting = False
        if self.world.plans[intent.message.intent].fails < ATTEMPTS:
            self.succeeded(intent.message.intent)
        else:
            intent.dead = intent.copies

    def succeeded(self, intent_id: str) -> None:
        """A plain intent's handler succeeded: its effect, and its child's, happen once."""
        intent = self.intents[intent_id]
        intent.effects, intent.dead = 1, 0
        child = getattr(intent.message, "child", "")
        if child:
            self.intents[child].effects = 1

    # Rules.

    @rule(batch=st.lists(work(), min_size=1, max_size=4))
    def send_work(self, batch: list[dict[str, Any]]) -> None:
        """Send or publish a few intents at once, some of them twice with one message id."""

        async def send() -> None:
            for spec in batch:
                intent = self.plain(spec)
                for _ in range(spec["copies"]):
                    await self._send(intent)

        self.run(send())

    @precondition(lambda self: bool(self.handled()))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """Send a handled message again with its message id: the inbox must drop it."""
        intent = data.draw(st.sampled_from(self.handled()))
        self.run(self._send(intent))

    @rule(
        tally=st.sampled_from(TALLIES),
        step=st.sampled_from(["open", "open", "add", "add", "add", "close"]),
        fails=st.sampled_from([0, 0, 1, ALWAYS]),
        kind=kinds,
        amount=st.integers(1, 100),
        copies=st.sampled_from([1, 1, 1, 2]),
    )
    def saga_message(
        self, tally: str, step: str, fails: int, kind: str, amount: int, copies: int
    ) -> None:
        """One message of a tally's saga, perhaps twice with one message id."""
        intent = self.saga_intent(tally, step, Plan(fails, kind), amount, copies)

        async def send() -> None:
            for _ in range(copies):
                await self._send(intent)

        self.run(send())

    def saga_intent(self, tally: str, step: str, plan: Plan, amount: int, copies: int) -> Intent:
        """Register a saga message in the world and the model."""
        intent_id = self.new_id("s")
        self.world.plans[intent_id] = plan
        message: Any
        if step == "open":
            message = TallyOpened(tally, intent_id)
        elif step == "add":
            message = TallyAdded(tally, intent_id, amount)
        else:
            message = TallyClosed(tally, intent_id, self.child())
        intent = Intent(message, uuid.uuid4().hex, False, plan.kind, saga=True)
        self.intents[intent_id] = intent
        if self.saga_runs(message):
            if plan.fails < ATTEMPTS:
                self.apply(message)
            else:
                intent.dead = copies
        return intent

    @precondition(lambda self: any(self.tallies.values()))
    @rule(data=st.data(), amounts=st.lists(st.integers(1, 100), min_size=2, max_size=6))
    def burst(self, data: st.DataObject, amounts: list[int]) -> None:
        """Several additions to one running tally at once: they race for its row."""
        tally = data.draw(st.sampled_from(sorted(t for t, m in self.tallies.items() if m)))

        async def send() -> None:
            for amount in amounts:
                plan = Plan(data.draw(st.sampled_from([0, 0, 1])))
                await self._send(self.saga_intent(tally, "add", plan, amount, 1))

        self.run(send())

    @precondition(lambda self: bool(self.timeouts) or any(i.waiting for i in self.sent()))
    @rule()
    def an_hour_passes(self) -> None:
        """Every saga timeout requested so far, and every deferred intent, comes."""
        transport = self.running.transport
        assert isinstance(transport, MemoryTransport)
        self.run(self._deliver(transport))
        for tally, generation in self.timeouts:
            running = self.tallies.get(tally)
            if running is not None and running.generation == generation:
                running.data.expired += 1
        self.timeouts.clear()
        for intent in self.sent():
            if intent.waiting:
                self.arrived(intent)

    async def _deliver(self, transport: MemoryTransport) -> None:
        transport.broker.deliver_delayed()

    @rule(
        before=st.lists(work(), max_size=2),
        blocker=st.sampled_from(["work", "work", "open", "add", "close"]),
        tally=st.sampled_from(TALLIES),
        fails=st.sampled_from([0, 1]),
        kind=kinds,
    )
    def restart_mid_message(
        self, before: list[dict[str, Any]], blocker: str, tally: str, fails: int, kind: str
    ) -> None:
        """Stop the app while a handler is blocked, then start a new one on the same state."""

        async def restart() -> None:
            for spec in before:
                intent = self.plain(spec)
                for _ in range(spec["copies"]):
                    await self._send(intent)
            await self._send(self.blocker(blocker, tally, fails, kind))
            assert self.world.blocked is not None
            async with asyncio.timeout(SETTLE):
                await self.world.blocked.wait()
            await self.running.stop()
            await self._start()

        self.run(restart())

    @rule(
        fails=st.lists(st.sampled_from([1, 2, ALWAYS]), min_size=1, max_size=3),
        moment=st.sampled_from([0.5, 0.95, 1.0, 1.05, 1.1, 1.5]),
    )
    def restart_while_hanging(self, fails: list[int], moment: float) -> None:
        """Stop the app about when hanging handlers run out of time, then start a new one."""

        async def restart() -> None:
            for n in fails:
                spec = {"fails": n, "kind": "hang", "effect": "row", "publish": False}
                await self._send(self.plain({**spec, "copies": 1, "child": True}))
            await asyncio.sleep(moment * HANDLER_TIMEOUT)
            await self.running.stop()
            await self._start()

        self.run(restart())

    def blocker(self, step: str, tally: str, fails: int, kind: str) -> Intent:
        """An intent whose handler blocks after its effect (a saga's method must run for it)."""
        if step == "work":
            spec = {"fails": fails, "kind": kind, "effect": "row", "publish": False}
            intent = self.plain({**spec, "copies": 1, "child": True})
        else:
            if not self.saga_runs(TallyAdded(tally, "", 0)):
                step = "open"
            # A saga's method runs holding SQLite's one connection (the saga was read): a hang
            # there would time out the messages sent before it while they wait for it.
            kind = "cancel" if kind == "hang" else kind
            intent = self.saga_intent(tally, step, Plan(fails, kind), 1, 1)
        self.world.plans[intent.message.intent].block = True
        return intent

    @precondition(lambda self: any(i.dead for i in self.intents.values()))
    @rule(data=st.data())
    def fix_and_replay(self, data: st.DataObject) -> None:
        """Fix a dead-lettered intent's handler and replay its dead letters."""
        dead = sorted(intent_id for intent_id, i in self.intents.items() if i.dead)
        intent_id = data.draw(st.sampled_from(dead))
        intent = self.intents[intent_id]
        self.world.plans[intent_id].fails = 0
        replays = self.run(self.dead_letters().replay({intent.message_id}))
        assert len(replays) == intent.dead, f"replayed {replays} of {intent.dead} copies"
        assert all(replay.done for replay in replays), replays
        if intent.saga:
            intent.dead = 0
            if self.saga_runs(intent.message):
                self.apply(intent.message)
        else:
            self.succeeded(intent_id)

    # The model of the saga.

    def saga_runs(self, message: Any) -> bool:
        """Whether a saga's method runs for the message (else it goes to `not_found`)."""
        return isinstance(message, TallyOpened) or self.tallies.get(message.tally) is not None

    def apply(self, message: Any) -> None:
        """What a saga message that succeeds does to the model."""
        running = self.tallies.get(message.tally)
        if isinstance(message, TallyOpened):
            if running is None:
                self.generations += 1
                running = TallyModel(self.generations, TallyData(message.tally))
                self.tallies[message.tally] = running
                self.timeouts.append((message.tally, running.generation))
            running.data.opens += 1
        elif running is None:
            return
        elif isinstance(message, TallyAdded):
            running.data.count += 1
            running.data.total += message.amount
        else:
            self.tallies[message.tally] = None
            self.intents[message.report].effects = 1

    # Checks.

    def sent(self) -> list[Intent]:
        """The intents the test sent itself (children are sent by handlers)."""
        return [i for i in self.intents.values() if i.message_id]

    def handled(self) -> list[Intent]:
        """The intents sent by the test that were handled (a saga's: perhaps by `not_found`)."""
        return [i for i in self.sent() if i.effects or (i.saga and not i.dead)]

    def dead_letters(self) -> DeadLetters:
        """The app's error queue, through the public reader."""
        return DeadLetters(self.running.transport, POLICY.error_queue, idle=0.005)

    @invariant()
    def every_intent_ends_once(self) -> None:
        """At rest: each intent's effect once, or its copies in the error queue with a reason."""
        if self.app is None:
            return
        self.run(self.settle())
        letters = self.run(self.dead_letters().peek(1_000))
        dead: Counter[str] = Counter()
        for letter in letters:
            intent_id = json.loads(letter.envelope.body).get("intent", "?")
            dead[intent_id] += 1
            self.check_reason(intent_id, letter)
        self.check_sagas()
        done = effects_in(self.path)
        for intent_id, intent in self.intents.items():
            ended = (done.pop(intent_id, 0), dead.pop(intent_id, 0))
            assert ended == (intent.effects, intent.dead), (
                f"{intent_id} ended with {ended[0]} effect(s) and {ended[1]} dead letter(s), "
                f"not {intent.effects} and {intent.dead}: {intent}"
            )
        assert not done, f"effects of intents never sent: {done}"
        assert not dead, f"dead letters of intents never sent: {dead}"

    def check_reason(self, intent_id: str, letter: DeadLetter) -> None:
        """A dead letter says why it is there: the error of its handler's last attempt."""
        intent = self.intents.get(intent_id)
        assert intent is not None, f"a dead letter of no intent: {letter.headers}"
        assert letter.error_message is not None, letter.headers
        assert ERROR_TYPES[intent.kind] in (letter.error_type or ""), (
            f"{intent_id} ({intent.kind}) dead-lettered as {letter.error_type}: "
            f"{letter.error_message}"
        )
        assert letter.source_queue == self.name

    def check_sagas(self) -> None:
        """Each tally's saga data (or its absence) is what the model says."""
        for tally in TALLIES:
            running = self.tallies.get(tally)
            stored = self.run(self.running.saga_data(Tally, tally))
            assert stored == (running.data if running else None), (
                f"saga {tally}: stored {stored}, the model says {running}"
            )

    async def settle(self) -> None:
        """Wait until nothing is queued, in flight, soon due or in the outbox (else: stuck)."""
        app = self.running
        transport = app.transport
        assert isinstance(transport, MemoryTransport)
        broker = transport.broker
        try:
            async with asyncio.timeout(SETTLE):
                calm = 0
                while calm < 3:
                    early = broker.deliver_delayed(within=1.0)  # delayed retries, not timeouts
                    quiet = (
                        not early
                        and all(queue.idle for queue in broker.queues.values())
                        and app.in_flight == 0
                        and not (app.storage is not None and await app.storage.pending())
                    )
                    calm = calm + 1 if quiet else 0
                    await asyncio.sleep(0 if calm else 0.002)
        except TimeoutError:
            queues = {name: (len(q), q.unacked) for name, q in broker.queues.items()}
            raise AssertionError(
                f"stuck: not at rest after {SETTLE:g}s; queues (ready, unacked) {queues}, "
                f"{app.in_flight} in flight, {broker.delayed} delayed"
            ) from None


@pytest.mark.timeout(900 if EXPLORE else 120)
class TestBusModel(BusModel.TestCase):  # type: ignore[misc,valid-type]
    """`make test`: the same 10 runs of up to 15 steps everywhere; `make fuzz`: 100 new ones."""

    settings = settings(
        max_examples=100 if EXPLORE else 10,
        stateful_step_count=15,
        derandomize=not EXPLORE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
