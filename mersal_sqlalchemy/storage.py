"""SqlStorage: a session per message, the inbox, `app.transaction(session)`, and the relay."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from mersal.context import MessageContext
from mersal.errors import ConfigurationError, Duplicate, MersalError
from mersal.handlers import Handlers
from mersal.inspection import StorageStatus
from mersal.messages import Header
from mersal.numbers import is_seconds
from mersal.outbox import Relay
from mersal.pipeline import Next
from mersal.settle import run_to_end
from mersal.status import Naming
from mersal.transaction import Transaction
from mersal_sqlalchemy.counts import outbox_counts, storage_status
from mersal_sqlalchemy.engines import (
    autocommits,
    database_url,
    is_postgresql,
    is_sqlite,
    make_engine,
)
from mersal_sqlalchemy.inbox import Inbox
from mersal_sqlalchemy.listener import Listener
from mersal_sqlalchemy.outbox import Executor, SqlOutboxStore, write_outbox
from mersal_sqlalchemy.sagas import SqlSagaStore
from mersal_sqlalchemy.schema import prepare_schema
from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, Tables, make_tables
from mersal_sqlalchemy.unit_of_work import CONNECTION as UNIT_CONNECTION
from mersal_sqlalchemy.unit_of_work import (
    GUARDED,
    LOST_ROLLBACK,
    ROLLED_BACK,
    SENDS,
    MessageAsyncConnection,
    MessageAsyncSession,
    close_connection,
    close_session,
    discard,
)

if TYPE_CHECKING:
    from mersal.app import App

log = logging.getLogger("mersal.sqlalchemy")

SESSION = "mersal_sqlalchemy.session"
"""The key of the message's AsyncSession in `MessageContext.items`."""
CONNECTION = "mersal_sqlalchemy.connection"
"""The key of the message's AsyncConnection in `MessageContext.items`."""

NO_SESSION = (
    "a dependency asked for the message's AsyncSession, but a {} message is handled on a Core "
    "connection, because its handlers ask for AsyncConnection and none for AsyncSession: "
    "ask for `session: AsyncSession` in a handler class's constructor (its AsyncConnection "
    "is then the session's), or write through the AsyncConnection"
)
NO_CONNECTION = (
    "a dependency asked for the message's AsyncConnection, but no handler of a {} message asks for "
    "one in its constructor, so none was opened: ask for `connection: AsyncConnection` in "
    "the handler class's constructor"
)


class AlreadyHandled(Duplicate):
    """The inbox holds the message's id: another copy of it committed first."""


def _is_session(dependency: object) -> bool:
    return isinstance(dependency, type) and issubclass(dependency, AsyncSession)


def _is_connection(dependency: object) -> bool:
    return isinstance(dependency, type) and issubclass(dependency, AsyncConnection)


def attach(
    app: App,
    *,
    outbox_table: str = DEFAULT_OUTBOX,
    inbox_table: str = DEFAULT_INBOX,
    retention: timedelta | float = timedelta(days=7),
    cleanup_interval: float = 300.0,
    cleanup_batch: int = 1_000,
    relay_batch: int = 500,
    poll_interval: float = 5.0,
    lease: float = 30.0,
    listen: bool = True,
    drain_timeout: float = 5.0,
    create_tables: bool | None = None,
    engine: AsyncEngine | None = None,
    engine_options: Mapping[str, Any] | None = None,
) -> SqlStorage:
    """Give `app` the SQL outbox and inbox of `app.settings.database` (or of `engine`).

    `App(database=...)` calls this with the defaults when it starts; call it yourself before
    the app starts to choose other options.
    """
    if app.storage is not None:
        raise ConfigurationError(f"app {app.name!r} already has a storage attached")
    tables = make_tables(outbox_table, inbox_table)
    database = app.settings.database
    owns_engine = engine is None
    if engine is None:
        if database is None:
            raise ConfigurationError(
                "attach(app) needs App(database=...) or attach(app, engine=...)"
            )
        url = database_url(database)
        options = {**engine_defaults(url.get_backend_name(), app.settings.concurrency)}
        options.update(engine_options or {})
        engine = make_engine(url, **options)
    elif not (is_postgresql(engine) or is_sqlite(engine)):
        raise ConfigurationError(
            "attach(app, engine=...) needs a PostgreSQL or SQLite engine, "
            f"not {engine.dialect.name}"
        )
    if autocommits(engine):
        raise ConfigurationError(
            "the engine runs in AUTOCOMMIT, where each statement commits on its own: a "
            "handler's rows, its outbox rows and its inbox row would no longer commit together "
            "(a failed handler would leave its rows, and its retry be skipped as a duplicate); "
            "give attach() an engine without isolation_level='AUTOCOMMIT'"
        )
    storage = SqlStorage(
        app,
        engine,
        tables,
        database=database or engine.url.render_as_string(hide_password=True),
        owns_engine=owns_engine,
        retention=_seconds(retention),
        cleanup_interval=_positive("cleanup_interval", cleanup_interval),
        cleanup_batch=int(_positive("cleanup_batch", cleanup_batch)),
        relay_batch=int(_positive("relay_batch", relay_batch)),
        poll_interval=_positive("poll_interval", poll_interval),
        lease=_positive("lease", lease),
        listen=listen,
        drain_timeout=drain_timeout,
        create_tables=is_sqlite(engine) if create_tables is None else create_tables,
    )
    app.handlers.provide(AsyncSession, storage.session_of)
    app.handlers.provide(MessageAsyncSession, storage.session_of)
    app.handlers.provide(AsyncConnection, storage.connection_of)
    app.handlers.provide(MessageAsyncConnection, storage.connection_of)
    app.use_storage(storage)
    return storage


class SqlStorage:
    """The SQL outbox, inbox and saga store of one app.

    Each incoming message is handled in a session and transaction of its own, which commits
    the handlers' writes, the outbox rows for what they sent and the inbox row together. The
    relay sends committed rows; it is woken by local commits, by PostgreSQL notifications from
    other processes, and by a slow poll.
    """

    def __init__(
        self,
        app: App,
        engine: AsyncEngine,
        tables: Tables,
        *,
        database: str,
        owns_engine: bool,
        retention: float,
        cleanup_interval: float,
        cleanup_batch: int,
        relay_batch: int,
        poll_interval: float,
        lease: float,
        listen: bool,
        drain_timeout: float,
        create_tables: bool,
    ) -> None:
        self.app = app
        self.engine = engine
        self.tables = tables
        self.database = database
        self.owns_engine = owns_engine
        self.sessions = async_sessionmaker(
            engine, class_=MessageAsyncSession, expire_on_commit=False
        )
        self.store = SqlOutboxStore(engine, tables.outbox, app.name, lease=lease)
        self.inbox = Inbox(
            engine, tables.inbox, app.name, retention=retention, cleanup_batch=cleanup_batch
        )
        self.sagas = SqlSagaStore(engine, tables.sagas, app.name, self.executor_of)
        self.cleanup_interval = cleanup_interval
        self.relay_batch = relay_batch
        self.poll_interval = poll_interval
        self.listen = listen and is_postgresql(engine)
        self.inbox_at_commit = is_sqlite(engine)
        self.drain_timeout = drain_timeout
        self.create_tables = create_tables
        self.relay: Relay | None = None
        self.listener: Listener | None = None
        self._channel = tables.channel if is_postgresql(engine) else None
        self._cleaner: asyncio.Task[None] | None = None

    def retry_command(self, row_id: int) -> str:
        """The `mersal outbox retry` command that un-parks one of this outbox's rows."""
        table = self.tables.outbox.name
        return Naming(database=self.database).outbox_retry(
            row_id, None if table == DEFAULT_OUTBOX else table
        )

    # Lifecycle.

    async def start(self) -> None:
        """Check (or create) the tables, then start the relay, the LISTEN and the inbox cleanup."""
        await prepare_schema(self.engine, self.tables, self.database, self.create_tables)
        self.relay = Relay(
            self.store,
            self.app.transport,
            batch=self.relay_batch,
            poll_interval=self.poll_interval,
            observer=self.app.observer,
            measure_backlog=self.backlog,
            retry_command=self.retry_command,
        )
        self.relay.start()
        if self.listen and self._channel is not None:
            self.listener = Listener(self.engine, self._channel, self.app.name, self.wake)
            await self.listener.start()
        self._cleaner = asyncio.create_task(
            self._clean_periodically(), name=f"mersal-inbox-cleanup-{self.app.name}"
        )

    async def stop(self) -> None:
        """Stop the cleanup, the LISTEN and the relay (after a last bounded flush); disconnect."""
        cleaner, self._cleaner = self._cleaner, None
        if cleaner is not None:
            cleaner.cancel()
            await asyncio.gather(cleaner, return_exceptions=True)
        listener, self.listener = self.listener, None
        if listener is not None:
            await listener.stop()
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.stop(self.drain_timeout)
        if self.owns_engine:
            await self.engine.dispose()

    @property
    def parked(self) -> int:
        """How many of this app's outbox rows are parked, as the relay last counted them."""
        return self.relay.parked_rows if self.relay is not None else 0

    def wake(self) -> None:
        """Have the relay look for rows now."""
        if self.relay is not None:
            self.relay.wake()

    async def pending(self) -> int:
        """How many of this app's outbox rows wait to be sent (parked ones not counted)."""
        return await self.store.pending()

    async def backlog(self) -> tuple[int, float]:
        """This app's pending outbox rows and the seconds the oldest has waited (0 with none)."""
        query = outbox_counts(self.engine, self.tables.outbox, self.app.name)
        async with self.engine.connect() as connection:
            counts = (await connection.execute(query)).one()
        return int(counts.pending), max(0.0, float(counts.age or 0.0))

    async def status(self, *, every_app: bool = False) -> StorageStatus:
        """This app's outbox and inbox counts (every app's with `every_app`): `mersal status`."""
        app = None if every_app else self.app.name
        return await storage_status(self.engine, self.tables, self.database, app)

    async def clean_inbox(self) -> int:
        """Delete this app's inbox ids older than the retention window; returns how many."""
        return await self.inbox.clean()

    async def _clean_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.cleanup_interval * random.uniform(0.5, 1.5))
            try:
                deleted = await self.clean_inbox()
            except Exception as error:
                log.warning("inbox cleanup failed (%s: %s)", type(error).__name__, error)
            else:
                if deleted:
                    log.info("removed %d expired message ids from the inbox", deleted)

    # The incoming steps.

    def session_of(self, context: MessageContext) -> AsyncSession:
        """The message's session (what handlers get for a `session: AsyncSession` parameter)."""
        session: AsyncSession | None = context.items.get(SESSION)
        if session is None:
            if context.items.get(CONNECTION) is not None:
                raise MersalError(NO_SESSION.format(_type_name(context)))
            raise MersalError("there is a session only while a message is being handled")
        return session

    def connection_of(self, context: MessageContext) -> AsyncConnection:
        """The message's connection (for a `connection: AsyncConnection` parameter)."""
        connection: AsyncConnection | None = context.items.get(CONNECTION)
        if connection is None:
            if context.items.get(SESSION) is not None:
                raise MersalError(NO_CONNECTION.format(_type_name(context)))
            raise MersalError("there is a connection only while a message is being handled")
        return connection

    def executor_of(self, context: MessageContext) -> AsyncSession | AsyncConnection:
        """What the message's transaction writes through: its session, or its connection."""
        executor = context.items.get(SESSION) or context.items.get(CONNECTION)
        if executor is None:
            raise MersalError("there is a transaction only while a message is being handled")
        return executor  # type: ignore[no-any-return]

    async def unit_of_work(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Handle the message in a transaction of its own, committed by the message's transaction.

        A message whose handlers ask for an AsyncConnection and none for an AsyncSession is
        handled on a Core connection; any other in an ORM session (whose connection is given
        to the handlers that ask for one).
        """
        asks = _asks(self.app.handlers, context.message_type)
        if asks == _CONNECTION_ONLY:
            connection = await MessageAsyncConnection.open(self.engine, context.transaction)
            context.items[CONNECTION] = connection
            context.transaction.session = connection
            try:
                await next(context)
            finally:
                await run_to_end(close_connection(connection))
            return
        session = self.sessions(info={GUARDED: True, SENDS: context.transaction})
        context.items[SESSION] = session
        context.transaction.session = session
        try:
            if asks == _BOTH:
                context.items[CONNECTION] = await MessageAsyncConnection.of_session(
                    self.engine, session, context.transaction
                )
            await next(context)
        finally:
            await run_to_end(close_session(session))

    async def check_inbox(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Refuse (`AlreadyHandled`) a message this app has handled already; record it otherwise.

        On PostgreSQL the id is recorded first, so that a copy being handled at the same time
        waits for this one. On SQLite it is looked up first and recorded at commit, so that
        the write transaction stays short; a copy that committed meanwhile is found then.
        """
        message_id = context.message_id
        if message_id:
            if self.inbox_at_commit:
                seen = await self.inbox.seen(message_id, context.items.get(CONNECTION))
            else:
                seen = not await self.inbox.record(self.executor_of(context), message_id)
            if seen:
                raise AlreadyHandled(message_id)
        await next(context)

    # Outside handlers.

    @asynccontextmanager
    async def transaction(self, session: Executor | None = None) -> AsyncIterator[Transaction]:
        """Bind sends to `session` (or a session of our own): outbox rows in its transaction.

        On a clean exit the rows are written and the session is committed; on an exception the
        session is rolled back and nothing is sent.
        """
        if session is not None and not isinstance(session, AsyncSession | AsyncConnection):
            raise ConfigurationError(
                f"app.transaction({type(session).__qualname__}): give it the AsyncSession or "
                "AsyncConnection of your own transaction (not an engine or a sync Session), or "
                "nothing for a session of the app's own"
            )
        executor: Executor = self.sessions() if session is None else session
        transaction = Transaction(self.commit, self.app, session=executor)
        try:
            yield transaction
            await transaction.commit()
        except BaseException:
            transaction.rollback()
            await run_to_end(discard(executor))
            raise
        finally:
            if session is None:
                assert isinstance(executor, AsyncSession)
                await run_to_end(executor.close())

    async def commit(self, transaction: Transaction) -> None:
        """Write the transaction's outbox rows in its session and commit; wake the relay.

        A message's attempt records its inbox row here too on SQLite. A message's session that
        was rolled back behind Mersal's back lost its inbox row: the commit fails rather than
        commit the handler's writes without it.
        """
        executor = transaction.session
        if executor is None:  # an attempt that had no unit of work: a session of our own
            async with self.sessions() as own:
                transaction.session = own
                await self.commit(transaction)
            return
        outgoing, table, channel = transaction.outgoing, self.tables.outbox, self._channel
        if isinstance(executor, MessageAsyncSession | MessageAsyncConnection):
            await self._check_message_transaction(executor, transaction)
            await write_outbox(executor, table, self.app.name, outgoing, channel)
            await executor.end(commit=True)
        else:
            assert isinstance(executor, AsyncSession | AsyncConnection)
            await write_outbox(executor, table, self.app.name, outgoing, channel)
            await executor.commit()
        if outgoing:
            self.wake()

    async def _check_message_transaction(
        self, executor: MessageAsyncSession | MessageAsyncConnection, transaction: Transaction
    ) -> None:
        """Refuse to commit a message's transaction that lost its writes; record its inbox row.

        A transaction rolled back behind Mersal's back lost its inbox row, and one aborted by a
        failed statement would roll back at COMMIT: the commit fails rather than lose them.
        """
        if isinstance(executor, MessageAsyncSession):
            if executor.info.get(ROLLED_BACK):
                raise MersalError(LOST_ROLLBACK)
            connection = executor.info.get(UNIT_CONNECTION)
            guarded = bool(executor.info.get(GUARDED))
        else:
            connection, guarded = executor, True
        failure = connection.failure if connection is not None else None
        if failure is not None:
            raise MersalError(failure)
        source = transaction.source
        inbox_id = source.headers.get(Header.MESSAGE_ID, "") if source is not None else ""
        at_commit = inbox_id and self.inbox_at_commit and guarded
        if at_commit and not await self.inbox.record(executor, inbox_id):
            raise AlreadyHandled(inbox_id, "meanwhile")


_CONNECTION_ONLY, _SESSION_ONLY, _BOTH = "connection", "session", "both"


def _asks(handlers: Handlers, message_type: type | None) -> str:
    """What a message type's handlers write through: a connection, a session, or both."""
    if message_type is None:
        return _SESSION_ONLY
    session = handlers.needs(message_type, _is_session)
    connection = handlers.needs(message_type, _is_connection)
    if connection:
        return _BOTH if session else _CONNECTION_ONLY
    return _SESSION_ONLY


def _type_name(context: MessageContext) -> str:
    return context.message_type.__qualname__ if context.message_type else "this"


def engine_defaults(backend: str, concurrency: int) -> dict[str, Any]:
    """The pool an app's engine gets on `backend` for `concurrency` messages at once."""
    if backend == "postgresql":
        # one connection per concurrent message, plus the relay's, the listener's and a spare
        return {"pool_size": max(concurrency + 3, 5), "max_overflow": 10}
    # SQLite writes one transaction at a time. One connection, handed out first come first
    # served, makes writers queue in the process instead of racing for SQLite's lock.
    return {"pool_size": 1, "max_overflow": 0, "pool_timeout": 300}


def _seconds(value: timedelta | float) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    return _positive("retention", seconds)


def _positive(name: str, value: float) -> float:
    if not is_seconds(value, zero=False, infinite=True):
        raise ConfigurationError(f"attach(app, {name}={value!r}) must be a number > 0")
    return value
