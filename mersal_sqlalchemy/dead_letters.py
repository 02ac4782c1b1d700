"""The dead-letter store: failed messages ingested from the error queues, looked at, retried.

Ingesting takes a batch from an error queue, inserts one row per message (a message delivered
again, because a crash came between the commit and its ack, meets its own row and is skipped)
and acks the batch once the rows committed: nothing is lost or stored twice wherever it stops.
Looking reads the table only. A retry writes the message's outbox row and deletes its row in
one transaction, so the app's relay sends it back to its source queue exactly once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import (
    ColumnElement,
    Insert,
    Integer,
    Table,
    any_,
    bindparam,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from mersal.app import App
from mersal.dead_letters import (
    DeadLetter,
    DeadLetters,
    check_limit,
    failure_group,
    letter_key,
    replayable,
)
from mersal.errors import ConfigurationError
from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_sqlalchemy.engines import is_postgresql, seconds_since
from mersal_sqlalchemy.outbox import write_outbox
from mersal_sqlalchemy.storage import SqlStorage
from mersal_sqlalchemy.tables import Tables

INGEST_BATCH = 100
"""The messages ingested in one transaction, by default."""

RETRY_BATCH = 500
"""The rows a retry or delete goes through per transaction."""

INSERT_BYTES = 32 * 1024 * 1024
"""The most bytes of bodies and headers one INSERT of an ingested batch carries."""

TOMBSTONE_SECONDS = 7 * 86_400.0
"""How long a retried or deleted failure's key is kept, so a late redelivery is not stored."""

PAGE = 50
"""The failures one page shows, by default."""

_encode_headers = msgspec.json.Encoder()
_decode_headers = msgspec.json.Decoder(dict[str, str])

Progress = Callable[[int], None]
"""Told the running count of rows done after each transaction of a group's retry or delete."""


@dataclass(frozen=True)
class Ingested:
    """What one batch of ingestion did: rows stored, and deliveries that had theirs already."""

    stored: int
    duplicates: int

    @property
    def taken(self) -> int:
        """The messages taken from the error queue (and acked)."""
        return self.stored + self.duplicates


@dataclass(frozen=True)
class StoredFailure:
    """A failed message in the store."""

    id: int
    error_queue: str
    source_queue: str | None
    message_id: str | None
    type_name: str | None
    error_type: str | None
    error_message: str | None
    handler: str | None
    attempts: int | None
    failed_at: datetime | None
    ingested_at: datetime
    group_key: str
    group_label: str
    traceback: str | None = None
    headers: dict[str, str] | None = None
    body: bytes | None = None
    """The traceback, headers and body: read by `get`, left out of pages."""


@dataclass(frozen=True)
class StoredGroup:
    """A failure group in the store: how many failed that way, first and last."""

    key: str
    label: str
    error_type: str | None
    handler: str | None
    count: int
    first_seen: datetime | None
    last_seen: datetime | None


@dataclass(frozen=True)
class Retried:
    """What a retry did: messages sent back (through the outbox), rows it could not send."""

    sent: int
    without_queue: list[int]
    """Rows with no source queue to go back to (no error-source-queue header, or it names the
    error queue itself): they stay."""


class DeadLetterStore:
    """One app's dead-letter table, with its outbox for retries.

    `app` names whose failures these are: its outbox rows carry the name, so that app's relay
    (or `send_retries`) sends the retried messages.
    """

    def __init__(self, engine: AsyncEngine, tables: Tables, app: str) -> None:
        if not app or not isinstance(app, str):
            raise ConfigurationError("DeadLetterStore(app=...) must name the app")
        self.engine = engine
        self.tables = tables
        self.table = tables.dead_letters
        self.app = app
        self._postgresql = is_postgresql(engine)
        self._channel = tables.channel if self._postgresql else None

    @classmethod
    def of(cls, app: App) -> DeadLetterStore:
        """The store in the database of `app`, once its SQL storage is attached (at start)."""
        storage = app.storage
        if not isinstance(storage, SqlStorage):
            raise ConfigurationError(
                f"app {app.name!r} has no SQL storage: give it App(database=...) and start it "
                "(or attach(app) first) before asking for its dead-letter store"
            )
        return cls(storage.engine, storage.tables, app.name)

    # Ingesting.

    async def ingest(self, dead_letters: DeadLetters, *, batch: int = INGEST_BATCH) -> Ingested:
        """Store up to `batch` messages of the error queue, then ack them (none: nothing done)."""
        check_limit(batch)
        async with dead_letters.take(batch) as held:
            if not held:
                return Ingested(0, 0)
            rows = [self.row_of(item.letter, dead_letters.queue) for item in held]
            async with self.engine.begin() as connection:
                stored = await self._insert(connection, rows)
            for item in held:
                await item.ack()
        return Ingested(stored, len(held) - stored)

    async def ingest_all(self, dead_letters: DeadLetters, *, batch: int = INGEST_BATCH) -> int:
        """Ingest batch after batch until the error queue is read to its end; the rows stored."""
        stored = 0
        while (done := await self.ingest(dead_letters, batch=batch)).taken:
            stored += done.stored
        return stored

    def row_of(self, letter: DeadLetter, queue: str) -> dict[str, Any]:
        """The row storing `letter`, taken from the error queue `queue`."""
        group = failure_group(letter)
        headers = letter.headers
        return {
            "app": self.app,
            "key": letter_key(queue, letter.envelope),
            "error_queue": _text(queue),
            "source_queue": _text(letter.source_queue),
            "message_id": _text(letter.message_id),
            "type_name": _text(letter.type_name),
            "error_type": _text(letter.error_type),
            "error_message": _text(letter.error_message),
            "traceback": _text(headers.get(Header.ERROR_TRACEBACK)),
            "handler": _text(group.handler),
            "attempts": _attempts(letter.attempts),
            "failed_at": letter.failed_at,
            "group_key": group.key,
            "group_label": _text(group.label) or "",
            "headers": _headers_text(headers),
            "body": letter.envelope.body,
        }

    async def _insert(self, connection: AsyncConnection, rows: list[dict[str, Any]]) -> int:
        """Insert the new rows, in statements of at most INSERT_BYTES of bodies and headers."""
        statement = self._insert_new().returning(self.table.c.id)
        stored = 0
        for chunk in _by_size(rows):
            stored += len((await connection.execute(statement, chunk)).all())
        return stored

    def _insert_new(self) -> Insert:
        if is_postgresql(self.engine):
            return postgresql.insert(self.table).on_conflict_do_nothing(index_elements=["key"])
        return sqlite.insert(self.table).on_conflict_do_nothing(index_elements=["key"])

    # Looking.

    async def count(self, group: str | None = None) -> int:
        """The failures stored (of `group`, a group's key)."""
        statement = select(func.count()).select_from(self.table).where(self._of(group))
        async with self.engine.connect() as connection:
            return int((await connection.execute(statement)).scalar_one())

    async def groups(self, *, limit: int = 200) -> list[StoredGroup]:
        """The failure groups, the most recently failed first."""
        t = self.table
        seen = func.coalesce(t.c.failed_at, t.c.ingested_at)
        statement = (
            select(
                t.c.group_key,
                func.min(t.c.group_label),
                func.min(t.c.error_type),
                func.min(t.c.handler),
                func.count(),
                func.min(seen),
                func.max(seen),
            )
            .where(self._of(None))
            .group_by(t.c.group_key)
            .order_by(func.max(seen).desc(), t.c.group_key)
            .limit(limit)
        )
        async with self.engine.connect() as connection:
            rows = (await connection.execute(statement)).all()
        return [StoredGroup(*row) for row in rows]

    async def page(
        self,
        *,
        group: str | None = None,
        search: str | None = None,
        before: int | None = None,
        limit: int = PAGE,
    ) -> list[StoredFailure]:
        """Failures newest first: of `group`, matching `search`, with ids below `before`."""
        check_limit(limit)
        t = self.table
        condition = self._of(group)
        if search:
            pattern = f"%{_like_escaped(search)}%"
            condition = condition & or_(
                *(
                    column.ilike(pattern, escape="\\")
                    for column in (t.c.message_id, t.c.type_name, t.c.error_type, t.c.error_message)
                )
            )
        if before is not None:
            condition = condition & (t.c.id < before)
        statement = select(*_listed(t)).where(condition).order_by(t.c.id.desc()).limit(limit)
        async with self.engine.connect() as connection:
            rows = (await connection.execute(statement)).all()
        return [StoredFailure(*row) for row in rows]

    async def existing(self, ids: Sequence[int]) -> set[int]:
        """Those of `ids` that are stored failures (not retried or deleted)."""
        found: set[int] = set()
        async with self.engine.connect() as connection:
            for start in range(0, len(ids), RETRY_BATCH):
                batch = ids[start : start + RETRY_BATCH]
                statement = select(self.table.c.id).where(self._of(None) & self._among(batch))
                found.update((await connection.execute(statement)).scalars())
        return found

    async def group_keys(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Up to `limit` keys of groups with failures whose key starts with `prefix`."""
        t = self.table
        statement = (
            select(t.c.group_key)
            .where(self._of(None) & t.c.group_key.startswith(prefix, autoescape=True))
            .distinct()
            .limit(limit)
        )
        async with self.engine.connect() as connection:
            return list((await connection.execute(statement)).scalars())

    async def get(self, row_id: int) -> StoredFailure | None:
        """One failure, with its traceback, headers and body; None if there is no such row."""
        t = self.table
        statement = select(*_listed(t), t.c.traceback, t.c.headers, t.c.body).where(
            self._of(None) & (t.c.id == row_id)
        )
        async with self.engine.connect() as connection:
            row = (await connection.execute(statement)).first()
        if row is None:
            return None
        *listed, traceback, headers, body = row
        failure = StoredFailure(*listed)
        return replace(failure, traceback=traceback, headers=_headers_of(headers), body=body)

    # Retrying and deleting.

    async def retry(self, ids: Sequence[int]) -> Retried:
        """Send these failures back to their source queues through the outbox, resolving them."""
        sent, kept = 0, []
        for start in range(0, len(ids), RETRY_BATCH):
            done = await self._retry_batch(ids[start : start + RETRY_BATCH])
            sent += done.sent
            kept.extend(done.without_queue)
        return Retried(sent, kept)

    async def _retry_batch(self, ids: Sequence[int]) -> Retried:
        """One transaction: the rows locked, their outbox rows written, the rows resolved."""
        t = self.table
        async with self.engine.begin() as connection:
            statement = (
                select(t.c.id, t.c.error_queue, t.c.headers, t.c.body)
                .where(self._of(None) & self._among(ids))
                .order_by(t.c.id)
                .with_for_update()
            )
            rows = (await connection.execute(statement)).all()
            outgoing: list[Outgoing] = []
            sent: list[int] = []
            without: list[int] = []
            for row_id, error_queue, headers_text, body in rows:
                headers = _sendable(_headers_of(headers_text))
                queue = headers.get(Header.ERROR_QUEUE)
                if not queue or queue == error_queue:
                    without.append(row_id)
                    continue
                outgoing.append(Outgoing(queue, replayable(Envelope(headers, body))))
                sent.append(row_id)
            await write_outbox(connection, self.tables.outbox, self.app, outgoing, self._channel)
            await self._resolve(connection, sent, "retried")
        return Retried(len(sent), without)

    async def retry_group(self, group: str, *, progress: Progress | None = None) -> Retried:
        """Retry every failure of `group` (a group's key), a batch per transaction."""
        sent, without = 0, []
        after = 0
        while ids := await self._ids(group, after):
            done = await self._retry_batch(ids)
            sent += done.sent
            without.extend(done.without_queue)
            after = ids[-1]
            if progress is not None:
                progress(sent)
        return Retried(sent, without)

    async def delete(self, ids: Sequence[int]) -> int:
        """Remove these failures for good; how many there were."""
        deleted = 0
        for start in range(0, len(ids), RETRY_BATCH):
            async with self.engine.begin() as connection:
                batch = ids[start : start + RETRY_BATCH]
                deleted += await self._resolve(connection, batch, "deleted")
        return deleted

    async def delete_group(self, group: str, *, progress: Progress | None = None) -> int:
        """Remove every failure of `group` for good, a batch per transaction; how many."""
        deleted = 0
        while ids := await self._ids(group, 0):
            deleted += await self.delete(ids)
            if progress is not None:
                progress(deleted)
        return deleted

    async def _resolve(self, connection: AsyncConnection, ids: Sequence[int], how: str) -> int:
        """Turn the rows into tombstones: their key stays, their message goes."""
        if not ids:
            return 0
        t = self.table
        statement = (
            update(t)
            .where(self._of(None) & self._among(ids))
            .values(resolved_at=func.now(), resolution=how, headers="{}", body=b"", traceback=None)
        )
        return int((await connection.execute(statement)).rowcount)

    async def forget(self, *, older_than: float = TOMBSTONE_SECONDS) -> int:
        """Drop the tombstones of failures resolved more than `older_than` seconds ago."""
        t = self.table
        cutoff = seconds_since(self.engine, t.c.resolved_at) > older_than
        statement = delete(t).where((t.c.app == self.app) & t.c.resolved_at.is_not(None) & cutoff)
        async with self.engine.begin() as connection:
            return int((await connection.execute(statement)).rowcount)

    async def _ids(self, group: str, after: int) -> list[int]:
        t = self.table
        statement = (
            select(t.c.id)
            .where(self._of(group) & (t.c.id > after))
            .order_by(t.c.id)
            .limit(RETRY_BATCH)
        )
        async with self.engine.connect() as connection:
            return list((await connection.execute(statement)).scalars())

    def _among(self, ids: Sequence[int]) -> ColumnElement[bool]:
        """`id` is one of `ids`: on PostgreSQL one array parameter (one statement to prepare,
        whatever the count), elsewhere IN with a parameter each."""
        column = self.table.c.id
        if not self._postgresql:
            return column.in_(list(ids))
        return column == any_(bindparam("ids", list(ids), type_=postgresql.ARRAY(Integer)))

    def _of(self, group: str | None) -> ColumnElement[bool]:
        condition = (self.table.c.app == self.app) & self.table.c.resolved_at.is_(None)
        return condition if group is None else condition & (self.table.c.group_key == group)


def _listed(t: Table) -> tuple[Any, ...]:
    """The columns of a page's row, in StoredFailure's order."""
    return (
        t.c.id,
        t.c.error_queue,
        t.c.source_queue,
        t.c.message_id,
        t.c.type_name,
        t.c.error_type,
        t.c.error_message,
        t.c.handler,
        t.c.attempts,
        t.c.failed_at,
        t.c.ingested_at,
        t.c.group_key,
        t.c.group_label,
    )


INT32 = 2**31 - 1
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
SURROGATES = re.compile("[\ud800-\udfff]")


def _attempts(value: int | None) -> int | None:
    """The attempts as the column holds them: a count a hostile header overflows is dropped."""
    return value if value is not None and 0 <= value <= INT32 else None


def _text(value: str | None) -> str | None:
    """`value` as a text column takes it: NUL and unpaired surrogates become U+FFFD."""
    return None if value is None else UNSTORABLE.sub("\ufffd", value)


def _headers_text(headers: dict[str, str]) -> str:
    """The headers as a JSON object; NUL and unpaired surrogates kept, as `\\u` escapes."""
    try:
        return _encode_headers.encode(headers).decode()
    except UnicodeEncodeError:
        return json.dumps(headers)


def _headers_of(text: str) -> dict[str, str]:
    try:
        return _decode_headers.decode(text)
    except msgspec.DecodeError:
        return dict(json.loads(text))


def _by_size(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows in runs of at most INSERT_BYTES (a row larger than that alone in its run)."""
    chunks: list[list[dict[str, Any]]] = [[]]
    size = 0
    for row in rows:
        weight = len(row["body"]) + len(row["headers"]) + len(row["traceback"] or "")
        if chunks[-1] and size + weight > INSERT_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(row)
        size += weight
    return chunks


def _sendable(headers: dict[str, str]) -> dict[str, str]:
    """The headers as a transport can send them: unpaired surrogates become U+FFFD."""
    return {SURROGATES.sub("\ufffd", k): SURROGATES.sub("\ufffd", v) for k, v in headers.items()}


def _like_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


__all__ = [
    "DeadLetterStore",
    "Ingested",
    "Retried",
    "StoredFailure",
    "StoredGroup",
]
