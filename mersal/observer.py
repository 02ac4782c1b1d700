"""What the core reports where no pipeline step can see: `mersal.telemetry` is one observer."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol

from mersal.context import MessageContext
from mersal.settle import Outcome
from mersal.transport import Outgoing, Transport


class Observer(Protocol):
    """Hears of deliveries, their outcomes and the sends no step makes (`App.observe`).

    Subclass it and override what you need: each report does nothing by default, and
    `send_each` just sends.
    """

    def received(self, context: MessageContext) -> None:
        """A delivery is about to be handled (once, whatever its attempts)."""

    def decided(self, context: MessageContext, outcome: Outcome) -> None:
        """The delivery's attempts came to `outcome`, which is carried out next."""

    async def send_each(
        self, transport: Transport, messages: Sequence[Outgoing], *, detached: bool
    ) -> list[Exception | None]:
        """`transport.send_each(messages)`, observed; `detached`: outside any message's trace
        (the outbox relay), else in the current one (a commit without an outbox)."""
        return await transport.send_each(messages)

    def skipped_duplicate(self, context: MessageContext) -> None:
        """The inbox had the message's id: it is acknowledged without being handled."""

    def outbox_measured(self, pending: int, oldest_age: float) -> None:
        """The relay counted its app's unsent outbox rows; the oldest has waited `oldest_age` s."""


REPORTS = ("received", "decided", "skipped_duplicate", "outbox_measured")
"""The reports every observer takes (beside `send_each`)."""


def problems(observer: object) -> list[str]:
    """What `observer` lacks to be an `Observer` (nothing if it is one)."""
    found = [f"{name}()" for name in REPORTS if not callable(getattr(observer, name, None))]
    if not inspect.iscoroutinefunction(getattr(observer, "send_each", None)):
        found.append("async send_each()")
    return found


async def send_each(
    observer: Observer | None,
    transport: Transport,
    messages: Sequence[Outgoing],
    *,
    detached: bool,
) -> list[Exception | None]:
    """Send every message through `transport`, seen by `observer` when there is one."""
    if observer is None:
        return await transport.send_each(messages)
    return await observer.send_each(transport, messages, detached=detached)
