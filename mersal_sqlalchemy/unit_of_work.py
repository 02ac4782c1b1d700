"""A message's unit of work: an ORM session or a Core connection that only Mersal ends.

Handlers write through the message's `AsyncSession` (the ORM) or its `AsyncConnection` (Core).
Either way the handlers' rows, the outbox rows of what they sent and the inbox row commit in
one transaction, after the handlers; a handler may not commit, roll back or close it, and a
savepoint it rolls back takes back the messages sent since the savepoint began.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from sqlalchemy import Connection, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, SessionTransaction

from mersal.errors import MersalError
from mersal.transaction import Transaction
from mersal_sqlalchemy.engines import ENDING, is_postgresql

log = logging.getLogger("mersal.sqlalchemy")

GUARDED = "mersal.guarded"
ROLLED_BACK = "mersal.rolled_back"
SENDS = "mersal.sends"
SAVEPOINTS = "mersal.savepoints"
CONNECTION = "mersal.connection"

REFUSED = (
    "do not {} the message's {} in a handler: Mersal commits it after the handlers, "
    "together with the outbox and inbox rows, or rolls it back when a handler raises. Raise to "
    "undo the message (it is retried), or undo part of it with a savepoint "
    "(`async with {}.begin_nested():`)"
)

LOST_ROLLBACK = (
    "the message's session was rolled back while the handlers ran (a failed flush, or a "
    "rollback outside Mersal), which undid its writes and its inbox row: the attempt fails and "
    "the message is retried. Undo part of a message with a savepoint "
    "(`async with session.begin_nested():`)"
)

LOST_CONNECTION_ROLLBACK = (
    "the message's connection was rolled back while the handlers ran (a failed flush, or a "
    "rollback outside Mersal), which undid its writes and its inbox row: the attempt fails and "
    "the message is retried. Undo part of a message with a savepoint "
    "(`async with connection.begin_nested():`)"
)

ABORTED = (
    "a statement on the message's connection failed ({}), which aborted its transaction on "
    "PostgreSQL: committing it would silently roll back the handlers' writes and the inbox "
    "row, so the attempt fails and the message is retried. To go on after a statement that "
    "may fail, run it in a savepoint (`async with connection.begin_nested():`)"
)


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
            raise MersalError(REFUSED.format(what, "session", "session"))

    async def end(self, commit: bool) -> None:
        """Commit or roll back (and close) as Mersal, at the end of the message."""
        self.info[ENDING] = True
        connection: MessageAsyncConnection | None = self.info.pop(CONNECTION, None)
        if connection is not None and connection.release():
            await connection.invalidate()
            commit = False
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
        raise MersalError(REFUSED.format("commit", "session", "session"))


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


@dataclass(slots=True)
class _Watch:
    """What Mersal keeps of a message's connection while its handlers run."""

    sends: Transaction
    aborts: bool
    """Whether a failed statement aborts the transaction (PostgreSQL's, outside savepoints)."""
    guarded: bool = True
    marks: list[int] = field(default_factory=list)
    """Per open savepoint, innermost last: how many messages were sent before it began."""
    failed: str | None = None
    refused_commit: bool = False
    """A commit was refused underneath SQLAlchemy, which then counts the transaction as over
    while the database's goes on: only dropping the DBAPI connection ends that one for sure."""


_WATCHED: weakref.WeakKeyDictionary[Connection, _Watch] = weakref.WeakKeyDictionary()
_ENGINES: weakref.WeakSet[object] = weakref.WeakSet()


class MessageAsyncConnection(AsyncConnection):
    """The message's Core connection, inside its transaction: Mersal ends it, never a handler.

    In a message handled on a connection it is the connection the transaction began on; in
    a message handled in a session it is the session's connection.
    """

    __slots__ = ()

    @classmethod
    async def open(cls, engine: AsyncEngine, sends: Transaction) -> MessageAsyncConnection:
        """Connect and begin the message's transaction on a connection of `engine`'s pool."""
        connection = cls(engine)
        await connection.start()
        try:
            await connection.begin()
        except BaseException:
            await connection.close()
            raise
        connection.watch(sends)
        return connection

    @classmethod
    async def of_session(
        cls, engine: AsyncEngine, session: AsyncSession, sends: Transaction
    ) -> MessageAsyncConnection:
        """The session's connection (its transaction begun), for handlers that ask for one.

        The session ends it: `MessageAsyncSession.end` releases it first.
        """
        connection = cls(engine, (await session.connection()).sync_connection)
        connection.watch(sends)
        session.info[CONNECTION] = connection
        return connection

    def watch(self, sends: Transaction) -> None:
        """Refuse commits, rollbacks and closes from here on; note the savepoints' sends."""
        inner = self.sync_connection
        assert inner is not None
        _listen(inner.engine)
        _WATCHED[inner] = _Watch(sends, aborts=is_postgresql(self.engine))

    def release(self) -> bool:
        """Let Mersal end the transaction: nothing is refused any longer.

        Returns whether the transaction must be ended by dropping the DBAPI connection.
        """
        inner = self.sync_connection
        watch = _WATCHED.pop(inner, None) if inner is not None else None
        if watch is None:
            return False
        watch.guarded = False
        return watch.refused_commit

    @property
    def failure(self) -> str | None:
        """Why the transaction cannot commit: rolled back, or aborted by a failed statement."""
        inner = self.sync_connection
        watch = _WATCHED.get(inner) if inner is not None else None
        return watch.failed if watch is not None else None

    async def commit(self) -> None:
        """Refused in a handler: the message's transaction commits after the handlers."""
        self._refuse("commit")
        await super().commit()

    async def rollback(self) -> None:
        """Refused in a handler: raise instead, or use a savepoint."""
        self._refuse("roll back")
        await super().rollback()

    async def close(self) -> None:
        """Refused in a handler: the connection belongs to the message."""
        self._refuse("close")
        await super().close()

    def _refuse(self, what: str) -> None:
        inner = self.sync_connection
        if inner is not None and inner in _WATCHED:
            raise MersalError(REFUSED.format(what, "connection", "connection"))

    async def end(self, commit: bool) -> None:
        """Commit or roll back as Mersal, at the end of the message; then return it to the pool."""
        if self.release():
            await super().invalidate()
            commit = False
        try:
            if commit:
                await super().commit()
        finally:
            await super().close()


def _listen(engine: object) -> None:
    """Watch the connections of `engine` (once per engine) for what handlers must not do."""
    if engine in _ENGINES:
        return
    _ENGINES.add(engine)
    event.listen(engine, "commit", _refuse_commit)
    event.listen(engine, "rollback", _note_rollback)
    event.listen(engine, "savepoint", _mark_savepoint)
    event.listen(engine, "release_savepoint", _release_savepoint)
    event.listen(engine, "rollback_savepoint", _rollback_savepoint)
    event.listen(engine, "handle_error", _note_failure)


def _refuse_commit(connection: Connection) -> None:
    """The same refusal for a commit that bypassed `MessageAsyncConnection.commit`."""
    watch = _WATCHED.get(connection)
    if watch is not None and watch.guarded:
        watch.refused_commit = True
        raise MersalError(REFUSED.format("commit", "connection", "connection"))


def _note_rollback(connection: Connection) -> None:
    """A rollback that bypassed Mersal (a failed flush, say) takes the inbox row with it."""
    watch = _WATCHED.get(connection)
    if watch is not None and watch.guarded:
        watch.failed = LOST_CONNECTION_ROLLBACK


def _mark_savepoint(connection: Connection, name: str | None) -> None:
    watch = _WATCHED.get(connection)
    if watch is not None:
        watch.marks.append(len(watch.sends.outgoing))


def _release_savepoint(connection: Connection, name: str, context: object) -> None:
    watch = _WATCHED.get(connection)
    if watch is not None and watch.marks:
        watch.marks.pop()


def _rollback_savepoint(connection: Connection, name: str, context: object) -> None:
    """A savepoint rolled back takes back the messages sent since it began."""
    watch = _WATCHED.get(connection)
    if watch is not None and watch.marks:
        sent_before = watch.marks.pop()
        if watch.sends.open:
            del watch.sends.outgoing[sent_before:]


def _note_failure(context: ExceptionContext) -> None:
    connection = context.connection
    watch = _WATCHED.get(connection) if connection is not None else None
    if watch is None or not watch.aborts or watch.failed is not None:
        return
    assert connection is not None
    if not connection.in_nested_transaction():
        error = context.original_exception
        first = (str(error).strip().splitlines() or [""])[0][:300]
        watch.failed = ABORTED.format(f"{type(error).__name__}: {first}" if first else error)


async def discard(executor: AsyncSession | AsyncConnection) -> None:
    """Roll back, keeping the error that led here rather than one from the rollback."""
    try:
        if isinstance(executor, MessageAsyncSession | MessageAsyncConnection):
            await executor.end(commit=False)
        else:
            await executor.rollback()
    except Exception as error:
        log.warning("rollback failed (%s: %s)", type(error).__name__, error)


async def close_session(session: MessageAsyncSession) -> None:
    """Close the message's session; what it did not commit is rolled back."""
    session.info[ENDING] = True
    connection: MessageAsyncConnection | None = session.info.pop(CONNECTION, None)
    try:
        if connection is not None and connection.release():
            await connection.invalidate()
        await session.close()
    except Exception as error:
        log.warning("closing the message's session failed (%s: %s)", type(error).__name__, error)


async def close_connection(connection: MessageAsyncConnection) -> None:
    """Return the message's connection to the pool; what it did not commit is rolled back."""
    try:
        await connection.end(commit=False)
    except Exception as error:
        log.warning("closing the message's connection failed (%s: %s)", type(error).__name__, error)
