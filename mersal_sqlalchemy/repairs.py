"""What `mersal outbox ...` does to outbox rows: list them, un-park them, purge them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import msgspec
from sqlalchemy import Table, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from mersal.dead_letters import Progress
from mersal.errors import MersalError
from mersal.messages import Header
from mersal_sqlalchemy.engines import is_postgresql

LIST_LIMIT = 100
"""The most rows `list_rows` returns unless told."""
PURGE_BATCH = 100
"""Rows deleted per statement by `purge_rows` (one transaction for them all)."""

_stored_headers = msgspec.json.Decoder(dict[str, str])


@dataclass(frozen=True)
class ListedRow:
    """An outbox row as `mersal outbox list` shows it (the body left out)."""

    id: int
    app: str
    address: str
    publish: bool
    type_name: str | None
    message_id: str | None
    attempts: int
    created_at: datetime | None
    parked_at: datetime | None
    parked_reason: str | None

    @property
    def parked(self) -> bool:
        """Whether the relay has set the row aside."""
        return self.parked_at is not None


async def list_rows(
    engine: AsyncEngine,
    table: Table,
    *,
    parked: bool = False,
    app: str | None = None,
    limit: int = LIST_LIMIT,
) -> tuple[list[ListedRow], int, int]:
    """Up to `limit` rows, oldest first, how many match in all, and how many are parked."""
    where: list[ColumnElement[bool]] = []
    if parked:
        where.append(table.c.parked_at.is_not(None))
    if app is not None:
        where.append(table.c.app == app)
    query = (
        select(
            table.c.id,
            table.c.app,
            table.c.address,
            table.c.publish,
            table.c.headers,
            table.c.attempts,
            table.c.created_at,
            table.c.parked_at,
            table.c.parked_reason,
        )
        .where(*where)
        .order_by(table.c.id)
        .limit(limit)
    )
    counting = select(func.count()).select_from(table).where(*where)
    parked_where = [*where, table.c.parked_at.is_not(None)]
    counting_parked = select(func.count()).select_from(table).where(*parked_where)
    async with engine.connect() as connection:
        records = (await connection.execute(query)).all()
        total = int((await connection.execute(counting)).scalar_one())
        parked_total = int((await connection.execute(counting_parked)).scalar_one())
    rows = []
    for record in records:
        headers = _headers(record.headers)
        rows.append(
            ListedRow(
                id=record.id,
                app=record.app,
                address=record.address,
                publish=bool(record.publish),
                type_name=headers.get(Header.TYPE),
                message_id=headers.get(Header.MESSAGE_ID),
                attempts=record.attempts,
                created_at=record.created_at,
                parked_at=record.parked_at,
                parked_reason=record.parked_reason,
            )
        )
    return rows, total, parked_total


def _headers(stored: str) -> dict[str, str]:
    try:
        return _stored_headers.decode(stored)
    except msgspec.DecodeError:
        return {}


async def retry_rows(
    engine: AsyncEngine, table: Table, ids: Sequence[int] | None, *, app: str | None = None
) -> list[int]:
    """Un-park rows (all parked ones for `ids=None`); returns the ids of those un-parked.

    On PostgreSQL the apps' relays are notified, so they send the rows at once rather than
    at their next poll.
    """
    statement = (
        update(table)
        .where(table.c.parked_at.is_not(None))
        .values(parked_at=None, parked_reason=None, lease_until=None)
        .returning(table.c.id, table.c.app)
    )
    if ids is not None:
        statement = statement.where(table.c.id.in_(ids))
    if app is not None:
        statement = statement.where(table.c.app == app)
    async with engine.begin() as connection:
        records = (await connection.execute(statement)).all()
        if is_postgresql(engine):
            for name in sorted({record.app for record in records}):
                await connection.execute(select(func.pg_notify(table.name, name)))
    return sorted(record.id for record in records)


class NotParked(MersalError):
    """`purge` was asked to delete rows that are not parked: nothing was deleted."""


async def purge_rows(
    engine: AsyncEngine,
    table: Table,
    ids: Sequence[int],
    progress: Progress | None = None,
    *,
    app: str | None = None,
) -> list[int]:
    """Delete these parked rows; a NotParked error (and nothing deleted) if any is not parked.

    With `app`, only that app's rows count: another app's ids are not in its outbox.
    `progress` is told `(done, total)` after each batch of deletes.
    """
    query = select(table.c.id, table.c.parked_at).where(table.c.id.in_(ids))
    if app is not None:
        query = query.where(table.c.app == app)
    if is_postgresql(engine):
        query = query.with_for_update()
    async with engine.begin() as connection:
        found = {record.id: record.parked_at for record in await connection.execute(query)}
        missing = sorted({i for i in ids if i not in found})
        waiting = sorted({i for i in ids if i in found and found[i] is None})
        if missing or waiting:
            problems = []
            if waiting:
                problems.append(f"not parked (the relay sends them): {id_list(waiting)}")
            if missing:
                problems.append(f"not in the outbox: {id_list(missing)}")
            raise NotParked(f"nothing purged; rows {'; '.join(problems)}")
        purged = sorted(set(ids))
        for start in range(0, len(purged), PURGE_BATCH):
            batch = purged[start : start + PURGE_BATCH]
            await connection.execute(
                delete(table).where(table.c.id.in_(batch), table.c.parked_at.is_not(None))
            )
            if progress is not None:
                progress(start + len(batch), len(purged))
    return purged


def id_list(ids: Sequence[int]) -> str:
    """The ids as `1, 2, 3`."""
    return ", ".join(str(i) for i in ids)
