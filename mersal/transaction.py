"""The transaction every outgoing message joins: buffered until commit, dropped on rollback."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar

from mersal.errors import MersalError
from mersal.transport import Outgoing

Commit = Callable[[Sequence[Outgoing]], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]


class TransactionClosed(MersalError):
    """A message was sent through a transaction that already committed or rolled back."""


class Transaction:
    """Buffers outgoing messages; `commit` hands them on in order, `rollback` forgets them."""

    __slots__ = ("_after_commit", "_commit", "_done", "outgoing", "owner")

    def __init__(self, commit: Commit, owner: object = None) -> None:
        self.outgoing: list[Outgoing] = []
        self.owner = owner
        self._commit = commit
        self._after_commit: list[Hook] = []
        self._done = False

    def enlist(self, outgoing: Outgoing) -> None:
        """Add a message to send when the transaction commits."""
        if self._done:
            raise TransactionClosed(
                "this transaction has ended: send from inside the handler or transaction block"
            )
        self.outgoing.append(outgoing)

    def replace_commit(self, commit: Commit) -> None:
        """Hand the buffered messages to `commit` instead (an outbox writes them as rows)."""
        self._commit = commit

    def after_commit(self, hook: Hook) -> None:
        """Run `hook` once the transaction has committed (for example, wake the outbox relay)."""
        self._after_commit.append(hook)

    async def commit(self) -> None:
        """Hand every buffered message on, in the order it was sent."""
        self._done = True
        await self._commit(self.outgoing)
        for hook in self._after_commit:
            await hook()

    def rollback(self) -> None:
        """Forget every buffered message."""
        self._done = True
        self.outgoing.clear()


current_transaction: ContextVar[Transaction | None] = ContextVar("mersal_transaction", default=None)
