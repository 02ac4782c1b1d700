"""The transaction every outgoing message joins: buffered until commit, dropped on rollback."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from mersal.errors import MersalError
from mersal.messages import Envelope, Header, derived_id, new_id
from mersal.transport import Outgoing

Commit = Callable[["Transaction"], Awaitable[None]]
"""Makes a transaction's buffered messages leave: as outbox rows, or handed to the transport."""
Hook = Callable[[], Awaitable[None]]

MESSAGE_IDS = uuid.UUID("6d9a3c1e-51b4-4c7e-9a53-0c1f6f0e8f2a")
"""The namespace of the message ids derived from an incoming message's id."""


def seed_of(envelope: Envelope | None) -> str | None:
    """What derived ids come from: the message's id, type and body; None without an id."""
    if envelope is None or not envelope.headers.get(Header.MESSAGE_ID):
        return None
    body = hashlib.blake2b(envelope.body, digest_size=16).hexdigest()
    return f"{envelope.headers[Header.MESSAGE_ID]}\x00{envelope.headers.get(Header.TYPE)}\x00{body}"


def id_namespace(app_name: str) -> bytes:
    """The namespace of the ids an app derives for what its handlers send."""
    return uuid.uuid5(MESSAGE_IDS, app_name).bytes


class TransactionClosed(MersalError):
    """A message was sent through a transaction that already committed or rolled back."""


class Transaction:
    """Buffers outgoing messages; `commit` hands them on in order, `rollback` forgets them.

    A transaction made for an incoming message (`source`; `ids`: the handling app's
    `id_namespace`) gives the messages sent through it ids derived from the message (its id,
    type and body) and their place in the sending order, so that a retry that sends the same
    messages sends them under the same ids, while two different messages that came with one id
    (a careless producer) do not lend their sends one id.
    """

    __slots__ = (
        "_after_commit",
        "_before_commit",
        "_commit",
        "_done",
        "_doomed",
        "_ended",
        "_ids",
        "_seed",
        "_sent",
        "_source",
        "outgoing",
        "owner",
        "session",
    )

    def __init__(
        self,
        commit: Commit,
        owner: object = None,
        source: Envelope | None = None,
        ids: bytes = MESSAGE_IDS.bytes,
        *,
        session: object = None,
    ) -> None:
        self.outgoing: list[Outgoing] = []
        self.owner = owner
        self.session = session
        self._commit = commit
        self._after_commit: list[Hook] = []
        self._before_commit: list[Hook] = []
        self._ended: list[Callable[[bool], None]] = []
        self._done = False
        self._doomed: str | None = None
        self._source = source
        self._seed: str | None = None
        self._ids = ids
        self._sent = 0

    @property
    def open(self) -> bool:
        """Whether messages can still join the transaction."""
        return not self._done

    @property
    def untouched(self) -> bool:
        """Open, and nothing has used it yet."""
        return not self._done and not self._sent and not self.outgoing and self.session is None

    def enlist(self, outgoing: Outgoing) -> None:
        """Add a message to send when the transaction commits."""
        if self._done:
            raise TransactionClosed(
                "this transaction has ended: send from inside the handler or transaction block, "
                "not from a task that outlives it"
            )
        self.outgoing.append(outgoing)

    def message_id(self) -> str:
        """The id for the next message sent through this transaction."""
        self._sent += 1
        if self._seed is None:
            self._seed = seed_of(self._source) or ""
        if not self._seed:
            return new_id()
        return derived_id(self._ids, f"{self._seed}\x00{self._sent}")

    @property
    def source(self) -> Envelope | None:
        """The incoming message whose attempt this transaction is, if any."""
        return self._source

    def before_commit(self, hook: Hook) -> None:
        """Run `hook` at commit, before the messages are handed on; if it raises, none are."""
        self._before_commit.append(hook)

    def when_ended(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(committed)` once a commit has been tried, whether it succeeded or not."""
        self._ended.append(callback)

    def after_commit(self, hook: Hook) -> None:
        """Run `hook` once the transaction has committed (for example, wake the outbox relay)."""
        self._after_commit.append(hook)

    def doom(self, reason: str) -> None:
        """Make the commit fail with `reason`: something inside the transaction went wrong."""
        if self._doomed is None:
            self._doomed = reason

    async def commit(self) -> None:
        """Hand every buffered message on, in the order it was sent."""
        if self._done:
            raise TransactionClosed("this transaction has ended already")
        self._done = True
        if self._doomed is not None:
            self.outgoing.clear()
            raise MersalError(self._doomed)
        committed = False
        try:
            for hook in self._before_commit:
                await hook()
            await self._commit(self)
            committed = True
        finally:
            for callback in self._ended:
                callback(committed)
        for hook in self._after_commit:
            await hook()

    def rollback(self) -> None:
        """Forget every buffered message (nothing, once committed)."""
        if not self._done:
            self._done = True
            self.outgoing.clear()


current_transaction: ContextVar[Transaction | None] = ContextVar("mersal_transaction", default=None)
"""The transaction sends join: the attempt's inside a handler, or an `app.transaction()` block's."""
