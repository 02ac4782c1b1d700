"""The ledger harness: a scenario's own database and vhost, its processes, and its figures.

A scenario (`Scenario`, an async context manager) creates a PostgreSQL database of its own
(migrated with `mersal_sqlalchemy.cli.upgrade`, plus the ledger tables) and a RabbitMQ vhost of
its own, runs the programs of `tests.chaos.worker` as OS processes (forked by `Zygote`) in fleets
(`Fleet`: keeps N processes of one kind alive, restarting those that die, with a budget of faulty
ones), injects faults from outside (broker connections closed, RabbitMQ or PostgreSQL stopped,
backends terminated), waits until everything drained, and counts:

- lost: committed Work intents without an effect;
- duplicated_effects: effect applications beyond one per intent (`effects.applied` counts the
  committed applications of one message id; more than one effect row for an intent counts too);
- raw_duplicate_deliveries: deliveries the workers took beyond one per message id (allowed);
- handler_reruns: handler runs beyond one per message id (allowed: a run that did not commit);
- unexpected: effects whose intent was never committed.

With sagas (`saga_figures`), each saga's committed data is compared with what the committed
intents say it must hold: every intent of its key exactly once, and a revision that went up
once per message it took.

At the end it kills every process it started, starts RabbitMQ and PostgreSQL again if it stopped
them, drops the database and deletes the vhost, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from uuid import uuid4

import aio_pika
import asyncpg
import pytest
from sqlalchemy.engine import make_url

from mersal_rabbitmq import RabbitMQTransport
from mersal_sqlalchemy.cli import upgrade
from tests.chaos.worker import ERROR_QUEUE, WORK_QUEUE
from tests.support import RABBITMQ_HOST, SBIN, add_vhost, delete_vhost, eventually, management

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = os.environ.get("MERSAL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_CLUSTER = os.environ.get("MERSAL_CHAOS_PG_CLUSTER", "15 main").split()

LEDGER_LINES: list[str] = []
"""Every scenario's ledger line, printed again at the end of the pytest run."""

LEDGER_TABLES = """
CREATE TABLE intents (
    id text PRIMARY KEY,
    kind text NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE effects (
    message_id text PRIMARY KEY,
    intent_id text NOT NULL,
    pid integer NOT NULL,
    applied integer NOT NULL DEFAULT 1,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_pid integer,
    last_at timestamptz
);
CREATE INDEX effects_intent ON effects (intent_id);
CREATE TABLE deliveries (
    seq bigserial PRIMARY KEY,
    message_id text NOT NULL,
    intent_id text,
    kind text NOT NULL,
    stage text NOT NULL,
    pid integer NOT NULL,
    redelivered boolean,
    attempt text,
    at timestamptz NOT NULL
);
"""

FIGURES = """
SELECT
  (SELECT count(*) FROM intents WHERE kind = 'work') AS intents,
  (SELECT count(*) FROM intents i WHERE i.kind = 'work'
     AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.intent_id = i.id)) AS lost,
  (SELECT coalesce(sum(applied), 0) - count(*) FROM effects) AS reapplied,
  (SELECT count(*) - count(DISTINCT intent_id) FROM effects) AS extra_effect_rows,
  (SELECT count(*) FROM effects e WHERE NOT EXISTS
     (SELECT 1 FROM intents i WHERE i.id = e.intent_id AND i.kind = 'work')) AS unexpected,
  (SELECT count(*) - count(DISTINCT message_id) FROM deliveries
     WHERE stage = 'received' AND kind = 'work') AS raw_duplicate_deliveries,
  (SELECT count(*) - count(DISTINCT message_id) FROM deliveries
     WHERE stage = 'handled' AND kind = 'work') AS handler_reruns,
  (SELECT count(*) FROM deliveries WHERE stage = 'received' AND kind = 'work') AS deliveries,
  (SELECT count(*) FROM mersal_outbox WHERE parked_at IS NOT NULL) AS parked,
  (SELECT count(*) FROM effects) AS effects
"""

PROGRESS = """
SELECT
  (SELECT count(*) FROM intents WHERE kind = 'work') AS committed,
  (SELECT count(DISTINCT e.intent_id) FROM effects e JOIN intents i
     ON i.id = e.intent_id AND i.kind = 'work') AS effected,
  (SELECT count(*) FROM mersal_outbox WHERE parked_at IS NULL) AS outbox
"""

SAGA_TABLE = "mersal_sagas"
"""The saga table of the default table names (`<inbox>_sagas`)."""

CONNECTION_TROUBLE = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InternalClientError,  # "cannot switch to state ..." on a terminated connection
)
"""What a query meets while PostgreSQL restarts or its backends are terminated."""


# Commands.


async def run(*command: str, timeout: float = 90.0, check: bool = True) -> str:
    """Run a command without blocking the loop; its output (a RuntimeError if it failed)."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise RuntimeError(f"{' '.join(command)}: no answer within {timeout}s") from None
    if check and process.returncode:
        raise RuntimeError(f"{' '.join(command)}: {err.decode() or out.decode()}")
    return out.decode()


def sbin(name: str) -> str:
    """The path of an administration command."""
    found = shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if found is None:
        raise FileNotFoundError(name)
    return found


async def rabbitmqctl(*args: str, timeout: float = 90.0) -> str:
    """`rabbitmqctl -q ARGS`."""
    return await run(sbin("rabbitmqctl"), "-q", *args, timeout=timeout)


async def pg_ctlcluster(action: str, *options: str) -> str:
    """`pg_ctlcluster 15 main ACTION` for the local cluster."""
    command = [sbin("pg_ctlcluster"), "--skip-systemctl-redirect", *PG_CLUSTER, action, *options]
    return await run(*command, timeout=120)


async def admin_connection() -> asyncpg.Connection:
    """A connection to the cluster's maintenance database."""
    return await asyncpg.connect(ADMIN_URL, timeout=10)


async def postgres_up() -> bool:
    """Whether PostgreSQL accepts connections now."""
    try:
        connection = await admin_connection()
    except (*CONNECTION_TROUBLE, asyncpg.PostgresError):
        return False
    await connection.close()
    return True


async def ensure_postgres() -> None:
    """Start the cluster if it is down, and wait until it accepts connections."""
    if await postgres_up():
        return
    with contextlib.suppress(RuntimeError):
        await pg_ctlcluster("start")
    await eventually(postgres_up, "PostgreSQL accepts connections", timeout=120, interval=0.3)


async def ensure_rabbitmq() -> None:
    """Start the RabbitMQ application if it is stopped, and wait until it has started."""
    with contextlib.suppress(RuntimeError):
        await rabbitmqctl("start_app")
    await rabbitmqctl("await_startup", timeout=180)


# Processes.


class Zygote:
    """`tests.chaos.zygote` in a process of its own: starts the programs, each one a fork."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self.procs: dict[int, Proc] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = 0

    async def open(self) -> None:
        """Start it: it imports the programs once."""
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), environment.get("PYTHONPATH")) if p
        )
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.chaos.zygote",
                cwd=ROOT,
                env=environment,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                limit=2**20,
            )
        self._reader = asyncio.create_task(self._read())

    def spawn(self, proc: Proc) -> None:
        """Ask for `proc`'s program; its pid, lines and end come to it as they happen."""
        assert self.process is not None and self.process.stdin is not None
        if self.process.returncode is not None or self._reader is None or self._reader.done():
            raise RuntimeError(f"the chaos zygote ended; its log:\n{tail(self.log_path, 30)}")
        self._ids += 1
        self.procs[self._ids] = proc
        request = {"id": self._ids, "argv": proc.argv, "log": str(proc.log_path)}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            async for raw in self.process.stdout:
                event = json.loads(raw)
                proc = self.procs[event["id"]]
                if "pid" in event:
                    proc.started(event["pid"])
                elif "line" in event:
                    proc.printed(event["line"])
                else:
                    proc.ended(event["code"])
        finally:
            # The zygote went (closed, or killed before it could kill its programs): kill what
            # still runs, since nothing reports their ends any more.
            for proc in self.procs.values():
                proc.signal(signal.SIGKILL)
                proc.ended(-signal.SIGKILL)

    async def close(self) -> None:
        """Close its stdin (it kills what is left) and wait for it."""
        if self.process is None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            async with asyncio.timeout(30):
                await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader


def tail(path: Path, lines: int) -> str:
    """The last lines of a log file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Proc:
    """One program of `tests.chaos.worker`, a process forked by the zygote; READY once it runs."""

    def __init__(
        self, zygote: Zygote, role: str, argv: Sequence[str], log_path: Path, faulty: bool
    ) -> None:
        self.zygote = zygote
        self.role = role
        self.argv = list(argv)
        self.log_path = log_path
        self.faulty = faulty
        self.ready = asyncio.Event()
        self.pid = 0
        self.code: int | None = None
        self.signalled: int | None = None
        self.signalled_at = 0.0
        self.ended_at = 0.0
        self._forked = asyncio.Event()
        self._ended = asyncio.Event()

    async def start(self, timeout: float = 60.0) -> bool:
        """Start the process; True once it printed READY, False if it ended (or hung) first."""
        self.zygote.spawn(self)
        await asyncio.wait_for(self._forked.wait(), timeout)  # the zygote answers at once
        ended = asyncio.ensure_future(self._ended.wait())
        ready = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait({ended, ready}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            ended.cancel()
        if not self.ready.is_set() and self.running:
            self.signal(signal.SIGKILL)
        return self.ready.is_set()

    def started(self, pid: int) -> None:
        """The zygote forked it."""
        self.pid = pid
        self._forked.set()

    def printed(self, line: str) -> None:
        """A line it printed on stdout."""
        if line.strip() == "READY":
            self.ready.set()

    def ended(self, code: int) -> None:
        """It ended with `code` (negative: the signal that ended it)."""
        if self.code is None:
            self.code = code
            self.ended_at = time.monotonic()
            self._ended.set()
            self._forked.set()

    @property
    def running(self) -> bool:
        """Whether the process has not ended yet."""
        return self.code is None

    def signal(self, signum: int) -> None:
        """Send a signal, if it still runs."""
        if self.running and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)
                if self.signalled is None:
                    self.signalled = signum
                    self.signalled_at = time.monotonic()

    async def wait(self) -> int:
        """Wait for the end; the exit code (negative: the signal that ended it)."""
        await self._ended.wait()
        assert self.code is not None
        return self.code

    def tail(self, lines: int = 12) -> str:
        """The last lines of its log."""
        return tail(self.log_path, lines)


@dataclass
class Exit:
    """How one process of a fleet ended."""

    pid: int
    code: int
    faulty: bool
    during_run: bool
    signalled: int | None


class Fleet:
    """`size` processes of one program, each replaced when it ends while the fleet is active.

    The first `faults` processes started get `faulty` added to their arguments (the fault they
    inflict on themselves); the ones after them run clean.
    """

    def __init__(
        self,
        scenario: Scenario,
        role: str,
        argv: Sequence[str],
        *,
        size: int = 1,
        faulty: Sequence[str] = (),
        faults: int = 0,
    ) -> None:
        self.scenario = scenario
        self.role = role
        self.argv = list(argv)
        self.size = size
        self.faulty = list(faulty)
        self.faults_left = faults if faulty else 0
        self.active = False
        self.live: list[Proc] = []
        self.started: list[Proc] = []
        self.exits: list[Exit] = []
        self.broken: str | None = None
        self._slots: list[asyncio.Task[None]] = []

    @property
    def kills(self) -> int:
        """How many faulty processes killed themselves (SIGKILL) while the fleet ran."""
        return sum(
            1
            for e in self.exits
            if e.faulty and e.during_run and e.code == -signal.SIGKILL and e.signalled is None
        )

    async def start(self, timeout: float = 120.0) -> Fleet:
        """Start the processes and wait until each printed READY."""
        self.active = True
        firsts = [asyncio.Event() for _ in range(self.size)]
        self._slots = [asyncio.create_task(self._slot(first)) for first in firsts]

        def started() -> bool:
            if self.broken:
                raise AssertionError(self.broken)
            return all(first.is_set() for first in firsts)

        try:
            await eventually(started, f"the {self.role} fleet started", timeout=timeout)
        except AssertionError as error:
            if self.broken:
                raise
            raise AssertionError(f"{error}\n{self.scenario.describe()}") from None
        return self

    async def _slot(self, first: asyncio.Event) -> None:
        failures = 0
        while self.active:
            faulty = self.faults_left > 0
            if faulty:
                self.faults_left -= 1
            proc = Proc(
                self.scenario.zygote,
                self.role,
                [*self.argv, *(self.faulty if faulty else ())],
                self.scenario.log_path(self.role),
                faulty,
            )
            self.live.append(proc)
            self.started.append(proc)
            try:
                ready = await proc.start()
            except (RuntimeError, TimeoutError) as error:  # the zygote is gone or mute
                self.live.remove(proc)
                self.started.remove(proc)
                self.broken = f"{self.role} could not be started: {error}"
                return
            if ready:
                first.set()
                failures = 0
            code = await proc.wait()
            self.live.remove(proc)
            self.exits.append(Exit(proc.pid, code, faulty, self.active, proc.signalled))
            if not ready:
                failures += 1
                if failures >= 8:
                    self.broken = (
                        f"{self.role} did not start {failures} times; last log:\n{proc.tail(30)}"
                    )
                    return
            if self.active:
                await asyncio.sleep(0.1 if ready else 1.0)

    def signal(self, signum: int) -> Proc:
        """Signal the oldest running process not signalled yet (the fleet replaces it)."""
        for proc in self.live:
            if proc.ready.is_set() and proc.running and proc.signalled is None:
                proc.signal(signum)
                return proc
        raise AssertionError(f"no running {self.role} process to signal\n{self.describe()}")

    async def stop(self, grace: float = 30.0) -> None:
        """SIGTERM every process (no replacements) and wait; SIGKILL what is left after `grace`."""
        self.active = False
        for proc in list(self.live):
            proc.signal(signal.SIGTERM)
        if not self._slots:
            return
        _, pending = await asyncio.wait(self._slots, timeout=grace)
        if pending:
            await self.kill()

    async def kill(self) -> None:
        """SIGKILL every process at once (no replacements) and wait for them."""
        self.active = False
        for _ in range(3):
            for proc in list(self.live):
                proc.signal(signal.SIGKILL)
            _, pending = await asyncio.wait(self._slots, timeout=10) if self._slots else ((), ())
            if not pending:
                return
        for proc in self.started:
            if proc.running:
                raise RuntimeError(f"{self.role} process {proc.pid} survived SIGKILL")

    def describe(self) -> str:
        """Its processes and how they ended, with the last log lines of the recent ones."""
        parts = [
            f"{self.role}: {len(self.live)} live, exits "
            + ", ".join(f"{e.pid}:{e.code}{'*' if e.faulty else ''}" for e in self.exits)
        ]
        for proc in self.started[-3:]:
            parts.append(f"--- {self.role} {proc.pid} ({proc.log_path.name}):\n{proc.tail()}")
        return "\n".join(parts)


# Figures.


@dataclass
class Figures:
    """What a scenario's ledger shows once everything drained."""

    intents: int
    lost: int
    duplicated_effects: int
    raw_duplicate_deliveries: int
    unexpected: int
    handler_reruns: int
    deliveries: int
    effects: int
    parked: int
    dead_lettered: int
    extra: dict[str, object] = field(default_factory=dict)

    def line(self, scenario: str, seconds: float) -> str:
        """`scenario=... intents=N lost=... duplicated_effects=... ... seconds=...`, then extras."""
        head = (
            f"scenario={scenario} intents={self.intents} lost={self.lost} "
            f"duplicated_effects={self.duplicated_effects} "
            f"raw_duplicate_deliveries={self.raw_duplicate_deliveries} "
            f"unexpected={self.unexpected} seconds={seconds:.1f}"
        )
        rest = {
            "handler_reruns": self.handler_reruns,
            "deliveries": self.deliveries,
            "dead_lettered": self.dead_lettered,
            "parked": self.parked,
            **self.extra,
        }
        return head + "".join(f" {key}={value}" for key, value in rest.items())


@dataclass
class SagaFigures:
    """One saga type's committed rows against the committed intents: all zero but `sagas`,
    `saga_ids` and `conflict_reruns` when they agree."""

    sagas: int = 0
    saga_ids: int = 0
    saga_mismatches: int = 0
    saga_missing_ids: int = 0
    saga_duplicate_ids: int = 0
    saga_foreign_ids: int = 0
    saga_revision_mismatches: int = 0
    conflict_reruns: int = 0
    problems: list[str] = field(default_factory=list)

    def fields(self) -> dict[str, object]:
        """The figures for the ledger line (the problems left out)."""
        return {k: v for k, v in vars(self).items() if k != "problems"}


@dataclass
class Progress:
    """Where a run stands: Work intents committed, of them effected, outbox rows waiting."""

    committed: int
    effected: int
    outbox: int


class Database:
    """The scenario database, seen from the harness: one connection (one query at a time),
    replaced when it is lost."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._connection: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    async def fetchrow(self, query: str, *args: object, patience: float = 180.0) -> asyncpg.Record:
        """One row; through PostgreSQL restarts and terminated backends, for `patience` s."""
        rows = await self.fetch(query, *args, patience=patience)
        assert rows, query
        return rows[0]

    async def fetch(
        self, query: str, *args: object, patience: float = 180.0
    ) -> list[asyncpg.Record]:
        """Every row; through PostgreSQL restarts and terminated backends, for `patience` s."""
        deadline = time.monotonic() + patience
        while True:
            try:
                async with self._lock:
                    if self._connection is None or self._connection.is_closed():
                        self._connection = await asyncpg.connect(self.dsn, timeout=10)
                    rows: list[asyncpg.Record] = await self._connection.fetch(
                        query, *args, timeout=60
                    )
                return rows
            except CONNECTION_TROUBLE:
                await self.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)

    async def close(self) -> None:
        """Close the connection, if any."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.terminate()


# The scenario.


class Scenario:
    """One fault scenario's world: its database, its vhost, its processes, its ledger."""

    def __init__(self, name: str, intents: int, logs: Path, *, protocol: str = "amqp") -> None:
        self.name = name
        self.intents = intents
        self.logs = logs
        self.key = uuid4().hex[:10]
        self.database_name = f"mersal_chaos_{self.key}"
        self.vhost = f"mersal-chaos-{self.key}"
        admin = make_url(ADMIN_URL)
        self.database = admin.set(
            drivername="postgresql+asyncpg", database=self.database_name
        ).render_as_string(hide_password=False)
        self.dsn = admin.set(drivername="postgresql", database=self.database_name).render_as_string(
            hide_password=False
        )
        self.amqp_url = f"amqp://guest:guest@{RABBITMQ_HOST}/{self.vhost}"
        self.transport = f"{protocol}://guest:guest@{RABBITMQ_HOST}/{self.vhost}"
        """What the apps connect with: amqp:// (0-9-1) or amqp10://; the test looks over 0-9-1."""
        self.db = Database(self.dsn)
        self.zygote = Zygote(logs / "zygote.log")
        self.fleets: list[Fleet] = []
        self.stopped_rabbitmq = False
        self.stopped_postgres = False
        self.started = time.monotonic()
        self._created_database = False
        self._created_vhost = False
        self._log_counter = 0

    # Setup and teardown.

    async def ctl(self, *args: str) -> str:
        """`rabbitmqctl -q ARGS` against the scenario's broker."""
        return await rabbitmqctl(*args)

    async def __aenter__(self) -> Scenario:
        self.started = time.monotonic()
        try:
            await asyncio.gather(self._create_database(), self._create_vhost(), self.zygote.open())
            await self._declare_queues()
        except BaseException:
            await self._teardown()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        problems = await self._teardown()
        if problems and exc is None:
            raise AssertionError("cleaning up failed: " + "; ".join(problems))

    async def _create_database(self) -> None:
        try:
            admin = await admin_connection()
        except (*CONNECTION_TROUBLE, asyncpg.PostgresError) as error:
            pytest.skip(f"PostgreSQL is not available at {ADMIN_URL}: {error}")
        try:
            await admin.execute(f'CREATE DATABASE "{self.database_name}"')
            self._created_database = True
        finally:
            await admin.close()
        await asyncio.to_thread(upgrade, self.database)
        connection = await asyncpg.connect(self.dsn, timeout=10)
        try:
            await connection.execute(LEDGER_TABLES)
        finally:
            await connection.close()

    async def _create_vhost(self) -> None:
        await asyncio.to_thread(add_vhost, self.vhost)
        self._created_vhost = True

    async def _declare_queues(self) -> None:
        """Declare the work queue as the worker app will, so the driver can send before it runs."""
        transport = RabbitMQTransport(self.amqp_url)
        await transport.start()
        try:
            await transport.declare(WORK_QUEUE)
            await transport.declare(ERROR_QUEUE)
        finally:
            await transport.stop()

    async def _teardown(self) -> list[str]:
        problems: list[str] = []

        async def attempt(what: str, action: Awaitable[object]) -> None:
            try:
                await action
            except Exception as error:
                problems.append(f"{what}: {type(error).__name__}: {error}")

        for fleet in self.fleets:
            await attempt(f"killing the {fleet.role} fleet", fleet.kill())
        await attempt("closing the zygote", self.zygote.close())
        await self.db.close()
        if self.stopped_rabbitmq:
            await attempt("starting RabbitMQ", ensure_rabbitmq())
        if self.stopped_postgres:
            await attempt("starting PostgreSQL", ensure_postgres())
        if self._created_database:
            await attempt("dropping the database", self._drop_database())
        if self._created_vhost:
            await attempt("deleting the vhost", asyncio.to_thread(delete_vhost, self.vhost))
        return problems

    async def _drop_database(self) -> None:
        admin = await admin_connection()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.database_name}" WITH (FORCE)')
        finally:
            await admin.close()

    # Processes.

    def log_path(self, role: str) -> Path:
        """A new log file for a process of `role`."""
        self._log_counter += 1
        return self.logs / f"{self._log_counter:03d}-{role}.log"

    def common(self) -> list[str]:
        """The options every program takes: the scenario's database and transport."""
        return ["--database", self.database, "--transport", self.transport]

    async def workers(
        self,
        size: int = 2,
        *options: str,
        faulty: Sequence[str] = (),
        faults: int = 0,
    ) -> Fleet:
        """Start `size` worker processes (kept alive); `faulty` for the first `faults` of them."""
        fleet = Fleet(
            self,
            "worker",
            ["work", *self.common(), *options],
            size=size,
            faulty=faulty,
            faults=faults,
        )
        self.fleets.append(fleet)
        return await fleet.start()

    async def driver(self, *options: str, faulty: Sequence[str] = (), faults: int = 0) -> Fleet:
        """Start the driver (kept alive until it committed everything and is stopped)."""
        fleet = Fleet(
            self,
            "driver",
            ["drive", *self.common(), "--intents", str(self.intents), *options],
            faulty=faulty,
            faults=faults,
        )
        self.fleets.append(fleet)
        return await fleet.start()

    async def stop_all(self) -> None:
        """Stop every fleet gracefully (SIGTERM), in the order they started."""
        for fleet in self.fleets:
            await fleet.stop()

    # Looking.

    async def progress(self) -> Progress:
        """Work intents committed, effected, and outbox rows waiting."""
        row = await self.db.fetchrow(PROGRESS)
        return Progress(row["committed"], row["effected"], row["outbox"])

    async def queue_depths(self) -> dict[str, int]:
        """Messages (ready and unacknowledged) per queue of the vhost."""
        out = await self.ctl(
            "list_queues", "-p", self.vhost, "name", "messages", "--no-table-headers"
        )
        depths: dict[str, int] = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                depths[parts[0]] = int(parts[1])
        return depths

    async def listed_depths(self) -> dict[str, int]:
        """Messages (ready and handed out) per queue as the management API lists them: at
        once for the names, a few seconds late for the counts (the broker publishes them)."""
        listed = await asyncio.to_thread(management, "GET", f"queues/{self.vhost}")
        return {row["name"]: int(row.get("messages") or 0) for row in listed}

    async def ready_counts(self, queues: Sequence[str] | None = None) -> dict[str, int]:
        """Messages ready (not those handed out) per queue, at once: passive declares.

        `queues`: these (0 for one that does not exist), else every queue of the vhost, as the
        management API lists them (it lists definitions at once; its counts lag, these do not).
        """
        if queues is None:
            listed = await asyncio.to_thread(management, "GET", f"queues/{self.vhost}")
            queues = [row["name"] for row in listed]
        counts: dict[str, int] = {}
        connection = await aio_pika.connect(self.amqp_url)
        try:
            channel = await connection.channel()
            for queue in queues:
                try:
                    declared = await channel.declare_queue(queue, passive=True)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    counts[queue] = 0
                    channel = await connection.channel()  # the broker closed that one
                    continue
                counts[queue] = int(declared.declaration_result.message_count or 0)
        finally:
            await connection.close()
        return counts

    def describe(self) -> str:
        """What the fleets did, for a failure message."""
        return "\n".join(fleet.describe() for fleet in self.fleets)

    async def until(
        self,
        condition: Callable[[], Awaitable[bool]],
        timeout: float,
        what: str,
        interval: float = 0.2,
    ) -> None:
        """Wait until `condition` holds; fail, saying where things stand, after `timeout` s.

        A fleet that cannot start its processes fails the wait at once.
        """

        async def holds() -> bool:
            if await condition():
                return True
            for fleet in self.fleets:
                if fleet.broken:
                    raise AssertionError(fleet.broken)
            return False

        try:
            await eventually(holds, what, timeout=timeout, interval=interval)
        except AssertionError as error:
            if any(fleet.broken for fleet in self.fleets):
                raise
            progress = await self.progress()
            raise AssertionError(f"{self.name}: {error} ({progress})\n{self.describe()}") from None

    async def until_progress(
        self, check: Callable[[Progress], bool], timeout: float, what: str
    ) -> None:
        """Wait until the progress passes `check`."""

        async def condition() -> bool:
            return check(await self.progress())

        await self.until(condition, timeout, what, interval=0.05)

    async def drained(self) -> bool:
        """Every intent committed and effected, the outbox empty, no message left in a queue."""
        progress = await self.progress()
        if progress.committed < self.intents or progress.effected < progress.committed:
            return False
        if progress.outbox:
            return False
        # ready counts are cheap and exact; only when none is left, ask rabbitmqctl (about a
        # second of an Erlang VM's CPU) for the deliveries handed out but not yet settled too
        ready = await self.ready_counts()
        if any(n for name, n in ready.items() if name != ERROR_QUEUE):
            return False
        depths = await self.queue_depths()
        return not any(n for name, n in depths.items() if name != ERROR_QUEUE)

    async def wait_drained(self, timeout: float) -> None:
        """Wait until everything drained."""
        await self.until(self.drained, timeout, "everything drained", interval=0.3)

    async def idle_in_transaction(self, older_than: float = 2.0) -> list[str]:
        """Sessions of the scenario database idle in a transaction for over `older_than` s."""
        admin = await admin_connection()
        try:
            rows = await admin.fetch(
                "SELECT pid, state, application_name, left(query, 80) AS query "
                "FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() "
                "AND state LIKE 'idle in transaction%' "
                "AND state_change < now() - make_interval(secs => $2)",
                self.database_name,
                older_than,
            )
        finally:
            await admin.close()
        return [f"{r['pid']} {r['state']}: {r['query']}" for r in rows]

    # Faults from outside.

    async def close_connections(self) -> None:
        """RabbitMQ closes every connection of the vhost (`rabbitmqctl close_all_connections`)."""
        await self.ctl("close_all_connections", "-p", self.vhost, "chaos: closed by the test")

    async def restart_rabbitmq(self, down_for: float) -> None:
        """`rabbitmqctl stop_app`, wait, `start_app`, and wait until it runs again."""
        self.stopped_rabbitmq = True
        await rabbitmqctl("stop_app")
        try:
            await asyncio.sleep(down_for)
        finally:
            await ensure_rabbitmq()

    async def terminate_backends(self) -> int:
        """`pg_terminate_backend` every session of the scenario database; how many."""
        admin = await admin_connection()
        try:
            terminated = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = $1 AND pid <> pg_backend_pid()",
                self.database_name,
            )
        finally:
            await admin.close()
        return int(terminated)

    async def restart_postgres(self, down_for: float) -> None:
        """Stop the cluster with `-m immediate` (a crash), wait, start it, wait for it."""
        self.stopped_postgres = True
        await self.db.close()
        await pg_ctlcluster("stop", "-m", "immediate")
        try:
            await asyncio.sleep(down_for)
        finally:
            await ensure_postgres()

    # The ledger.

    async def figures(self, **extra: object) -> Figures:
        """Count the ledger (run it once everything drained and stopped)."""
        row = await self.db.fetchrow(FIGURES)
        depths = await self.ready_counts([ERROR_QUEUE])  # nothing consumes it
        return Figures(
            intents=row["intents"],
            lost=row["lost"],
            duplicated_effects=row["reapplied"] + row["extra_effect_rows"],
            raw_duplicate_deliveries=row["raw_duplicate_deliveries"],
            unexpected=row["unexpected"],
            handler_reruns=row["handler_reruns"],
            deliveries=row["deliveries"],
            effects=row["effects"],
            parked=row["parked"],
            dead_lettered=depths.get(ERROR_QUEUE, 0),
            extra=dict(extra),
        )

    async def saga_figures(self, app: str, saga: str, key_of: Callable[[str], str]) -> SagaFigures:
        """Compare the rows of saga type `saga` of `app` with the committed Work intents.

        Each saga whose data lists intent ids (`{"key": ..., "ids": [...]}`) must list exactly
        the committed intents whose key (`key_of(intent)`) is its correlation value, each once,
        and be at revision len(ids): one save per message it took. `conflict_reruns`: attempts
        the workers logged as ended by a ConcurrencyConflict (stage "conflict").
        """
        intents = await self.db.fetch("SELECT id FROM intents WHERE kind = 'work'")
        expected: dict[str, set[str]] = {}
        for row in intents:
            expected.setdefault(key_of(row["id"]), set()).add(row["id"])
        rows = await self.db.fetch(
            f"SELECT correlation, id, revision, data FROM {SAGA_TABLE} "
            "WHERE app = $1 AND saga = $2 ORDER BY correlation",
            app,
            saga,
        )
        conflicts = await self.db.fetchrow(
            "SELECT count(*) AS n FROM deliveries WHERE stage = 'conflict'"
        )
        found = SagaFigures(sagas=len(rows), conflict_reruns=conflicts["n"])
        stored = {row["correlation"]: row for row in rows}
        for key in sorted(expected.keys() | stored.keys()):
            want = expected.get(key, set())
            row = stored.get(key)
            if row is None:
                found.saga_mismatches += 1
                found.saga_missing_ids += len(want)
                found.problems.append(f"{key}: no saga row ({len(want)} intents)")
                continue
            data = json.loads(row["data"])
            ids: list[str] = data.get("ids", [])
            counts = Counter(ids)
            missing = sorted(want - counts.keys())
            duplicates = sorted(i for i, n in counts.items() if n > 1)
            foreign = sorted(counts.keys() - want)
            found.saga_ids += len(ids)
            found.saga_missing_ids += len(missing)
            found.saga_duplicate_ids += sum(counts[i] - 1 for i in duplicates)
            found.saga_foreign_ids += len(foreign)
            wrong: list[str] = []
            if missing:
                wrong.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
            if duplicates:
                wrong.append(f"twice or more {duplicates[:5]}")
            if foreign:
                wrong.append(f"not its own {foreign[:5]}")
            if data.get("key") != key:
                wrong.append(f"data key {data.get('key')!r}")
            if row["revision"] != len(ids):
                found.saga_revision_mismatches += 1
                wrong.append(f"revision {row['revision']} for {len(ids)} ids")
            if wrong:
                found.saga_mismatches += 1
                found.problems.append(f"{key} (saga {row['id']}): " + ", ".join(wrong))
        return found

    async def finish(
        self,
        drain_timeout: float,
        *,
        more: Callable[[], Awaitable[Mapping[str, object]]] | None = None,
        **extra: object,
    ) -> Figures:
        """Drain, check the sessions, stop everything, count, print, and check the invariants.

        lost = 0, duplicated_effects = 0, unexpected = 0, no session idle in transaction.
        `more`: further figures for the line, counted once every process stopped.
        """
        await self.wait_drained(drain_timeout)
        idle = await self.idle_in_transaction()
        await self.stop_all()
        if more is not None:
            extra.update(await more())
        kills = {fleet.role: fleet.kills for fleet in self.fleets if fleet.kills}
        for role, count in kills.items():
            extra.setdefault(f"{role}_kills", count)
        figures = await self.figures(**extra)
        line = figures.line(self.name, time.monotonic() - self.started)
        LEDGER_LINES.append(line)
        print(line, flush=True)
        assert figures.intents == self.intents, line
        assert figures.lost == 0, line
        assert figures.duplicated_effects == 0, line
        assert figures.unexpected == 0, line
        assert idle == [], f"sessions left idle in transaction: {idle}"
        return figures

    def exits(self, role: str) -> list[Exit]:
        """How the processes of `role` ended."""
        return [e for fleet in self.fleets if fleet.role == role for e in fleet.exits]
