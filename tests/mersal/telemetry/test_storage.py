"""What only the storage sees: inbox duplicates, and the outbox backlog the relay measures."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from opentelemetry.trace import StatusCode

from mersal import App, Header, OutcomeUnknown, Outgoing, message
from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import attach
from tests.mersal.telemetry.support import Recorder, value
from tests.support import DelegatingTransport, eventually


@message("tests.mersal.telemetry.Refund.v1")
@dataclass
class Refund:
    amount: int


async def test_a_duplicate_the_inbox_skips_is_counted_and_marked(
    otel: Recorder, tmp_path: Path
) -> None:
    name = f"refunds-{uuid.uuid4().hex[:8]}"
    app = App(
        name,
        transport=f"memory://telemetry-{uuid.uuid4().hex}",
        database=f"sqlite+aiosqlite:///{tmp_path / 'app.db'}",
        concurrency=1,  # the copies one after the other: the second finds the first's id
    )
    handled: list[Refund] = []

    async def refund(command: Refund) -> None:
        handled.append(command)

    app.register(Refund, refund)
    otel.instrument(app)
    async with app:
        for _ in range(2):
            await app.send_local(Refund(3), headers={Header.MESSAGE_ID: "refund-1"})
        await eventually(lambda: len(otel.spans(f"process {name}")) == 2, "both copies handled")

    assert handled == [Refund(3)]
    first, second = otel.spans(f"process {name}")
    assert "mersal.inbox.duplicate" not in (first.attributes or {})
    assert (second.attributes or {})["mersal.inbox.duplicate"] is True
    assert second.status.status_code is StatusCode.UNSET
    duplicates = otel.points("mersal.inbox.duplicates")
    assert value(duplicates, messaging__destination__name=name, messaging__system="memory") == 1
    assert otel.metric("mersal.inbox.duplicates").unit == "{message}"


class Unconfirmed(DelegatingTransport):
    """A transport whose broker never confirms a publish."""

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Nothing is confirmed."""
        return [OutcomeUnknown("no confirm") for _ in messages]


@pytest.mark.integration
async def test_the_outbox_gauges_show_what_waits_and_for_how_long(
    otel: Recorder, postgres_url: str
) -> None:
    name = f"refunds-{uuid.uuid4().hex[:8]}"
    transport = cast(Transport, Unconfirmed(MemoryTransport(f"memory://{uuid.uuid4().hex}")))
    app = App(name, transport=transport, database=postgres_url)
    app.route(Refund, name)
    attach(app, poll_interval=0.05)
    otel.instrument(app)
    async with app:
        async with app.transaction():
            await app.send(Refund(1))
            await app.send(Refund(2))
        pending = await eventually(
            lambda: [p for p in otel.points("mersal.outbox.pending") if p.value == 2],
            "both rows pending",
        )
        aged = await eventually(
            lambda: [p for p in otel.points("mersal.outbox.oldest_age") if p.value > 0.1],
            "the oldest row waiting",
        )

    assert [point.attributes for point in pending + aged] == [{"mersal.app": name}] * 2
    failed = otel.spans(f"send {name}")
    assert failed
    assert {(span.attributes or {})["error.type"] for span in failed} == {
        "mersal.errors.OutcomeUnknown"
    }
    sent = otel.points("messaging.client.sent.messages")
    assert value(sent, error__type="mersal.errors.OutcomeUnknown") == len(failed)
