"""An app's status for operators: its queues, error queue, outbox and inbox in one view.

It only looks: nothing is declared, consumed or created, and the app is not started. The
broker is asked through the transport's `queue_status` (`QueueInspector`), the database through
the storage's `status` (`StorageInspector`); an adapter without them is named as such.
`mersal status` (`mersal.cli.status`) shows it; `app_status(app)` gives it in the app's process.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from mersal.app import App
from mersal.errors import ConfigurationError
from mersal.inspection import (
    ERROR,
    INPUT,
    QUEUE,
    WAIT,
    QueueInspector,
    QueueReport,
    QueueStatus,
    StorageInspector,
    StorageStatus,
)
from mersal.messages import shown
from mersal.outbox import Storage
from mersal.plugins import storage_for
from mersal.text import align
from mersal.transport import Transport, partition_queue
from mersal.urls import mask, without_password

PROBE_APP = "mersal-status"
"""The app name of the storage probe made when no app is named (its name filters nothing)."""


@dataclass(frozen=True)
class Naming:
    """How the commands `mersal status` suggests name the app, the broker and the database.

    A URL is None where the suggested command finds it by itself (the `--app`'s broker,
    MERSAL_TRANSPORT or MERSAL_DATABASE); a suggested command never shows a password.
    """

    app: str | None = None
    """The `module:app` status was given, for `mersal dlq --app`."""
    app_name: str | None = None
    transport: str | None = None
    database: str | None = None

    def dlq_list(self, queue: str) -> str:
        """The `mersal dlq list` command that lists `queue`, and what to add to it, if anything."""
        app = f" --app {self.app}" if self.app else ""
        variable = None if self.app else "MERSAL_TRANSPORT"  # --app's broker wins over it
        option, note = _url_option("--transport", self.transport, variable)
        return f"`mersal dlq list{app} --queue {queue}{option}`{note}"

    def outbox_list(self) -> str:
        """The `mersal outbox list --parked` command for the parked rows, and what to add to it."""
        app = f" --app {self.app_name}" if self.app_name else ""
        option, note = _url_option("--database", self.database, "MERSAL_DATABASE")
        return f"`mersal outbox list --parked{app}{option}`{note}"

    def failures_groups(self) -> str:
        """The `mersal failures groups` command for the stored failures, and what to add to it."""
        if self.app:
            return f"`mersal failures groups --app {self.app}`"
        name = f" --name {self.app_name}" if self.app_name else " --name APP"
        option, note = _url_option("--database", self.database, "MERSAL_DATABASE")
        return f"`mersal failures groups{name}{option}`{note}"

    def outbox_retry(self, row_id: int, table: str | None = None) -> str:
        """The `mersal outbox retry` command that un-parks a row, and what to add to it."""
        option, note = _url_option("--database", self.database, "MERSAL_DATABASE")
        in_table = f" --outbox-table {table}" if table else ""
        return f"`mersal outbox retry {row_id}{option}{in_table}`{note}"


def _url_option(option: str, url: str | None, variable: str | None) -> tuple[str, str]:
    """` --option 'URL'` for a suggested command (no password shown), and what to add to it."""
    if url is None or (variable is not None and url == os.environ.get(variable)):
        return "", ""
    shown = without_password(url)
    if shown == url:
        return f" {option} '{url}'", ""
    instead = f", or set {variable} to the URL and leave {option} out" if variable else ""
    return f" {option} '{shown}'", f" (its URL without the password: add the password{instead})"


@dataclass
class StatusQuery:
    """What a status is counted from: the transport and the queues to count, the database."""

    app: App | None = None
    transport: Transport | None = None
    queues: list[tuple[str, str]] = field(default_factory=list)
    """(name, role) of every queue to count, the wait queues aside."""
    waits_of: list[str] = field(default_factory=list)
    delays: tuple[float, ...] = ()
    database: str | None = None
    management: str | None = None
    naming: Naming = field(default_factory=Naming)


@dataclass
class Status:
    """What `mersal status` saw; `exit_code` and `reasons` say what it comes to."""

    app: str | None = None
    broker: str | None = None
    queues: list[QueueStatus] = field(default_factory=list)
    unacked_note: str | None = None
    database: str | None = None
    storage: StorageStatus | None = None
    naming: Naming = field(default_factory=Naming)

    @property
    def missing(self) -> list[QueueStatus]:
        """The queues that do not exist."""
        return [queue for queue in self.queues if not queue.exists]

    def problems(self) -> list[str]:
        """What needs an operator, each with what to do about it."""
        problems = []
        for queue in self.queues:
            held = (queue.ready or 0) + (queue.unacked or 0)
            if queue.role == ERROR and held:
                problems.append(
                    f"{held} message(s) in the error queue {queue.name!r}: look at them with "
                    f"{self.naming.dlq_list(queue.name)}, then replay them (`mersal dlq replay`)"
                )
        if self.storage is not None and self.storage.failures:
            of_app = f" of app {self.storage.app!r}" if self.storage.app else ""
            problems.append(
                f"{self.storage.failures} failed message(s){of_app} in the dead-letter store: "
                f"group them with {self.naming.failures_groups()}, then `mersal failures retry` "
                "(or `delete`) them, or open `mersal dashboard`"
            )
        if self.storage is not None and self.storage.parked:
            of_app = f" of app {self.storage.app!r}" if self.storage.app else ""
            problems.append(
                f"{self.storage.parked} parked outbox row(s){of_app}: look at them with "
                f"{self.naming.outbox_list()}, fix the cause, then `mersal outbox retry` (or "
                "`purge`) them"
            )
        return problems

    def unseen(self) -> str | None:
        """Why the view is incomplete (queues that do not exist), or None."""
        missing = self.missing
        if not missing:
            return None
        names = ", ".join(repr(queue.name) for queue in missing)
        own = {INPUT, ERROR} & {queue.role for queue in missing}
        hint = "the app declares its queues when it starts" if own else "check the name"
        return f"no queue {names} on {self.broker}: {hint} (nothing was created)"

    @property
    def exit_code(self) -> int:
        """2 when it could not see everything, 1 when something needs an operator, else 0."""
        if self.unseen() is not None:
            return 2
        return 1 if self.problems() else 0

    def reasons(self) -> list[str]:
        """Why the exit code is not 0: one line for 2, one per problem for 1."""
        unseen = self.unseen()
        return [unseen] if unseen is not None else self.problems()

    def as_json(self) -> dict[str, Any]:
        """The status as one JSON object (the shape is in docs/operations.md)."""
        storage = self.storage
        return {
            "app": self.app,
            "exit_code": self.exit_code,
            "reasons": self.reasons(),
            "broker": self.broker,
            "queues": [
                {
                    "name": queue.name,
                    "role": queue.role,
                    "exists": queue.exists,
                    "ready": queue.ready,
                    "unacked": queue.unacked,
                    "consumers": queue.consumers,
                    "wait_of": queue.wait_of,
                }
                for queue in self.queues
            ],
            "unacked_note": self.unacked_note,
            "database": self.database,
            "outbox": None
            if storage is None
            else {
                "app": storage.app,
                "pending": storage.pending,
                "parked": storage.parked,
                "oldest_pending_age": storage.oldest_pending_age,
                "apps": [
                    {
                        "app": rows.app,
                        "pending": rows.pending,
                        "parked": rows.parked,
                        "oldest_pending_age": rows.oldest_pending_age,
                        "selected": rows.app == storage.app,
                    }
                    for rows in storage.apps
                ],
            },
            "inbox": None if storage is None else {"app": storage.app, "rows": storage.inbox},
            "failures": None if storage is None else storage.failures,
        }

    def lines(self) -> list[str]:
        """The status as text for a terminal."""
        lines = [f"app {self.app!r}"] if self.app else []
        if self.broker is not None:
            lines.append(f"broker {self.broker}")
            header = ("QUEUE", "ROLE", "READY", "UNACKED", "CONSUMERS")
            lines.extend(align([header, *(_cells(queue) for queue in self.queues)]))
            if self.unacked_note is not None:
                lines.append(f"unacked ?: {self.unacked_note}")
        storage = self.storage
        if storage is not None:
            rows_of = f" (the rows of app {storage.app!r})" if storage.app else ""
            lines.append(f"database {self.database}{rows_of}")
            lines.append(f"outbox: {_pending(storage)}, {storage.parked} parked")
            if storage.others:
                lines.extend(_by_app(storage))
            lines.append(f"inbox: {storage.inbox} row(s)")
            if storage.failures is not None:
                lines.append(f"dead-letter store: {storage.failures} failed message(s)")
        if self.exit_code == 0:
            lines.append("ok: nothing needs an operator")
        return lines


def _cells(queue: QueueStatus) -> tuple[str, ...]:
    if not queue.exists:
        return (queue.name, queue.role, "no such queue", "-", "-")
    return (
        queue.name,
        queue.role,
        _count(queue.ready),
        _count(queue.unacked),
        _count(queue.consumers),
    )


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _by_app(storage: StorageStatus) -> list[str]:
    """Every app's outbox rows, one line each, the counted app marked with `*`.

    An app name is the table's to show as it is written: escaped, one word, cut if long.
    """
    header = ("  APP", "PENDING", "PARKED", "OLDEST PENDING")
    rows = [
        (
            f"{'*' if rows.app == storage.app else ' '} {shown(rows.app)}",
            str(rows.pending),
            str(rows.parked),
            "-" if rows.oldest_pending_age is None else f"{rows.oldest_pending_age:.1f}s",
        )
        for rows in storage.apps
    ]
    lines = align([header, *rows])
    if storage.app is not None:
        lines.append(
            f"  (* is app {storage.app!r}: the outbox line above and the exit status count its "
            "rows only)"
        )
    return lines


def _pending(storage: StorageStatus) -> str:
    age = storage.oldest_pending_age
    oldest = "" if age is None else f" (the oldest {age:.1f}s old)"
    return f"{storage.pending} pending{oldest}"


async def look(query: StatusQuery) -> Status:
    """Count the query's queues and its database's outbox and inbox rows; change nothing."""
    status = Status(app=query.app.name if query.app is not None else None, naming=query.naming)
    if query.transport is not None:
        status.broker = mask(query.transport.address)
        report = await queue_report(query)
        roles = dict(query.queues)
        status.queues = [
            queue if queue.role == WAIT else replace(queue, role=roles.get(queue.name, QUEUE))
            for queue in report.queues
        ]
        status.unacked_note = report.note
    if query.database is not None:
        status.database = mask(query.database)
        status.storage = await storage_status(query)
    return status


async def queue_report(query: StatusQuery) -> QueueReport:
    """The transport's counts of the query's queues (and their wait queues)."""
    transport = query.transport
    if not isinstance(transport, QueueInspector):
        raise ConfigurationError(
            f"the transport {type(transport).__name__} ({mask(getattr(transport, 'address', '?'))})"
            " cannot count its queues: it has no queue_status() method"
        )
    return await transport.queue_status(
        [name for name, _ in query.queues],
        waits_of=query.waits_of,
        delays=query.delays,
        management=query.management,
    )


async def storage_status(query: StatusQuery) -> StorageStatus:
    """The storage's counts of the outbox and inbox rows (the app's, or every app's)."""
    async with storage_of(query) as storage:
        if not isinstance(storage, StorageInspector):
            raise ConfigurationError(
                f"the storage {type(storage).__name__} for {mask(query.database or '')} cannot "
                "count its outbox and inbox rows: it has no status() method"
            )
        return await storage.status(every_app=query.app is None)


@asynccontextmanager
async def storage_of(query: StatusQuery) -> AsyncIterator[Storage]:
    """The storage the app has, or a new one for `query.database`; stopped after, unless running.

    An app without a storage is left without one: the new one belongs to a probe app of the
    same name.
    """
    app = query.app
    if app is not None and app.storage is not None and query.database == app.settings.database:
        storage, owned = app.storage, not app.running
    else:
        name = app.name if app is not None else PROBE_APP
        database = query.database or ""
        storage = storage_for(App(name, transport="memory://", database=database), database)
        owned = True
    try:
        yield storage
    finally:
        if owned:
            await storage.stop()


async def app_status(app: App, *, management: str | None = None) -> Status:
    """The status of `app` (running or not) in this process: its queues, outbox and inbox."""
    return await look(query_for(app, management=management))


def query_for(
    app: App,
    *,
    transport: Transport | None = None,
    database: str | None = None,
    error_queue: str | None = None,
    queues: Sequence[str] = (),
    management: str | None = None,
) -> StatusQuery:
    """What to look at for `app`: its transport, database, input, error and wait queues."""
    named: list[tuple[str, str]] = []
    if app.settings.consume:  # a send-only app declares neither queue
        named += [(app.name, INPUT), (error_queue or app.retry.error_queue, ERROR)]
        partitions = app.settings.partitions or 0
        named[1:1] = [(partition_queue(app.name, n), INPUT) for n in range(partitions)]
    elif error_queue is not None:
        named.append((error_queue, ERROR))
    named += [(name, QUEUE) for name in queues]
    transport = transport or app.transport
    database = database or app.settings.database
    return StatusQuery(
        app=app,
        transport=transport,
        queues=distinct_queues(named),
        waits_of=[name for name, role in named if role in (INPUT, QUEUE)],
        delays=tuple(app.retry.delayed),
        database=database,
        management=management,
        naming=Naming(app_name=app.name, transport=transport.address, database=database),
    )


def distinct_queues(queues: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each queue once, with the role it was first named with."""
    seen: dict[str, str] = {}
    for name, role in queues:
        seen.setdefault(name, role)
    return list(seen.items())
