"""SqlStorage: a session per message, the inbox, `app.transaction(session)`, and the relay."""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, SessionTransaction

from mersal.context import MessageContext
from mersal.errors import ConfigurationError, Duplicate, MersalError
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
    ENDING,
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

if TYPE_CHECKING:
    from mersal.app import App

log = logging.getLogger("mersal.sqlalchemy")

SESSION = "mersal_sqlalchemy.session"
"""The key of the message's AsyncSession in `MessageContext.items`."""

GUARDED = "mersal.guarded"
ROLLED_BACK = "mersal.rolled_back"
SENDS = "mersal.sends"
SAVEPOINTS = "mersal.savepoints"

REFUSED = (
    "do not {} the message's session in a handler: Mersal commits it after the handlers, "
    "together with the outbox and inbox rows, or rolls it back when a handler raises. Raise to "
    "undo the message (it is retried), or undo part of it with a savepoint "
    "(`async with session.begin_nested():`)"
)


LOST_ROLLBACK = (
    "the message's session was rolled back while the handlers ran (a failed flush, or a "
    "rollback outside Mersal), which undid its writes and its inbox row: the attempt fails and "
    "the message is retried. Undo part of a message with a savepoint "
    "(`async with session.begin_nested():`)"
)


class AlreadyHandled(Duplicate):
    """The inbox holds the message's id: another copy of it committed first."""


class MessageSession(Session):
    """The session class behind every AsyncSession the storage opens."""


class MessageAsyncSession(AsyncSession):
    """The message's session: Mersal ends it (commit or rollback), never a handler."""

    sync_session_class = MessageSession

    async def commit(self) -> None:
        """Refused in a handler: the message's transaction commits after the handlers."""
        self._refuse_in_handler("commit")
        await super().commit()

    async def rollback(self) -> None:
        """Refused in a handler: raise instead, or use a savepoint."""
        self._refuse_in_handler("roll back")
        await super().rollback()

    async def close(self) -> None:
        """Refused in a handler: the session belongs to the message."""
        self._refuse_in_handler("close")
        await super().close()

    def _refuse_in_handler(self, what: str) -> None:
        if self.info.get(GUARDED) and not self.info.get(ENDING):
            raise MersalError(REFUSED.format(what))

    async def end(self, commit: bool) -> None:
        """Commit or roll back (and close) as Mersal, at the end of the message."""
        self.info[ENDING] = True
        if commit:
            await super().commit()
        else:
            await super().rollback()


@event.listens_for(MessageSession, "before_commit")
def _refuse_handler_commits(session: Session) -> None:
    """A message's session commits only with its transaction, outbox and inbox rows included.

    A savepoint (`begin_nested()`) may commit: that only ends the savepoint.
    """
    if (
        session.info.get(GUARDED)
        and not session.info.get(ENDING)
        and not session.in_nested_transaction()
    ):
        raise MersalError(REFUSED.format("commit"))


@event.listens_for(MessageSession, "after_transaction_create")
def _mark_savepoints(session: Session, transaction: SessionTransaction) -> None:
    """A savepoint notes how many messages were sent before it began."""
    sends: Transaction | None = session.info.get(SENDS)
    if sends is not None and transaction.nested:
        marks = session.info.setdefault(SAVEPOINTS, weakref.WeakKeyDictionary())
        marks[transaction] = len(sends.outgoing)


@event.listens_for(MessageSession, "after_soft_rollback")
def _note_rollbacks(session: Session, previous: SessionTransaction) -> None:
    """A rollback nobody asked Mersal for (the sync session's) takes the inbox row with it.

    A savepoint's rollback undoes only what was done since the savepoint: its rows, and the
    messages sent since it began. A failed flush rolls back its own inner transaction, which
    undoes the savepoint around it, or everything when there is none.
    """
    undone = previous
    while not undone.nested and undone.parent is not None:
        undone = undone.parent
    if undone.nested:
        sends: Transaction | None = session.info.get(SENDS)
        sent_before = session.info.get(SAVEPOINTS, {}).pop(undone, None)
        if sends is not None and sends.open and sent_before is not None:
            del sends.outgoing[sent_before:]
    elif session.info.get(GUARDED) and not session.info.get(ENDING):
        session.info[ROLLED_BACK] = True


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
        self.sagas = SqlSagaStore(engine, tables.sagas, app.name, self.session_of)
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
            raise MersalError("there is a session only while a message is being handled")
        return session

    async def unit_of_work(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Handle the message in a session of its own, committed by the message's transaction."""
        session = self.sessions(info={GUARDED: True, SENDS: context.transaction})
        context.items[SESSION] = session
        context.transaction.session = session
        try:
            await next(context)
        finally:
            await run_to_end(_end(session))

    async def check_inbox(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Refuse (`AlreadyHandled`) a message this app has handled already; record it otherwise.

        On PostgreSQL the id is recorded first, so that a copy being handled at the same time
        waits for this one. On SQLite it is looked up first and recorded at commit, so that
        the write transaction stays short; a copy that committed meanwhile is found then.
        """
        message_id = context.message_id
        if message_id:
            if self.inbox_at_commit:
                seen = await self.inbox.seen(message_id)
            else:
                seen = not await self.inbox.record(self.session_of(context), message_id)
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
            await run_to_end(_discard(executor))
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
        if isinstance(executor, MessageAsyncSession):
            if executor.info.get(ROLLED_BACK):
                raise MersalError(LOST_ROLLBACK)
            source = transaction.source
            inbox_id = source.headers.get(Header.MESSAGE_ID, "") if source is not None else ""
            at_commit = inbox_id and self.inbox_at_commit and executor.info.get(GUARDED)
            if at_commit and not await self.inbox.record(executor, inbox_id):
                raise AlreadyHandled(inbox_id, "meanwhile")
            await write_outbox(executor, table, self.app.name, outgoing, channel)
            await executor.end(commit=True)
        else:
            assert isinstance(executor, AsyncSession | AsyncConnection)
            await write_outbox(executor, table, self.app.name, outgoing, channel)
            await executor.commit()
        if outgoing:
            self.wake()


async def _discard(executor: Executor) -> None:
    """Roll back, keeping the error that led here rather than one from the rollback."""
    try:
        if isinstance(executor, MessageAsyncSession):
            await executor.end(commit=False)
        else:
            await executor.rollback()
    except Exception as error:
        log.warning("rollback failed (%s: %s)", type(error).__name__, error)


async def _end(session: MessageAsyncSession) -> None:
    """Close the message's session; what it did not commit is rolled back."""
    session.info[ENDING] = True
    try:
        await session.close()
    except Exception as error:
        log.warning("closing the message's session failed (%s: %s)", type(error).__name__, error)


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
