"""Saga headers (`saga-type`, `saga-id`) make a timeout only with a valid `saga-check`.

Any producer can copy them onto a message, or make them up. A timeout the app requested
carries the check: it reaches the saga instance that requested it, and is ignored once that
has ended. Headers naming an instance that runs reach it, check or not (a timeout requested
before the check existed). Otherwise, without the check, a correlated message is handled as
what its type says (its saga, a new one, or `not_found`), and a timeout type (a method, no
correlation) goes to the error queue. Also what `request_timeout` refuses at the call.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from lagom import Container

from mersal import App, Header, RetryPolicy
from mersal.sagas import Saga, saga_check
from mersal.testing import Harness

QUEUE = "tickets"
ERRORS = "tickets.error"


@dataclass
class Reply:
    ticket: str | None


@dataclass
class Nudge:
    """Correlated by a function of the ticket, which raises for a ticket not a number."""

    ticket: str


@dataclass
class Open:
    ticket: str
    timeout: Reply | None = None
    """The Reply to request as a timeout, if any (a correlated type)."""
    nudge: bool = False
    """Request a Nudge as a timeout."""


@dataclass
class Close:
    ticket: str


@dataclass
class Remind:
    """The Tickets saga's timeout type: a method, no correlation."""

    ticket: str


@dataclass
class Ticket:
    ticket: str = ""
    replies: int = 0
    reminded: int = 0


@dataclass
class Probe:
    runs: Counter[str] = field(default_factory=Counter)
    saga_ids: dict[str, str] = field(default_factory=dict)
    not_found: list[object] = field(default_factory=list)


class Tickets(Saga[Ticket], name="tests.headers.Tickets"):
    started_by = (Open,)
    correlation = {
        Open: "ticket",
        Reply: "ticket",
        Close: "ticket",
        Nudge: lambda nudge: f"t-{int(nudge.ticket)}",
    }

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    async def open(self, message: Open) -> None:
        self.probe.runs["open"] += 1
        self.probe.saga_ids[message.ticket] = self.saga_id
        self.data.ticket = message.ticket
        if message.timeout is not None:
            await self.request_timeout(3600, message.timeout)
        if message.nudge:
            await self.request_timeout(3600, Nudge(message.ticket))

    async def nudge(self, message: Nudge) -> None:
        self.probe.runs["nudge"] += 1

    async def reply(self, message: Reply) -> None:
        self.probe.runs["reply"] += 1
        self.data.replies += 1

    async def close(self, message: Close) -> None:
        self.probe.runs["close"] += 1
        self.mark_complete()

    async def remind(self, timeout: Remind) -> None:
        self.probe.runs["remind"] += 1
        self.data.reminded += 1

    async def not_found(self, message: object) -> None:
        self.probe.not_found.append(message)


class Escalations(Saga[Ticket], name="tests.headers.Escalations"):
    """A second saga that takes Reply, correlated by the same attribute, and Remind."""

    started_by = (Reply,)
    correlation = {Reply: "ticket"}

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    async def reply(self, message: Reply) -> None:
        self.probe.runs["escalation reply"] += 1
        self.data.replies += 1

    async def remind(self, timeout: Remind) -> None:
        self.probe.runs["escalation remind"] += 1


def tickets_app(probe: Probe, *sagas: type[Saga[Ticket]]) -> App:
    container = Container()
    container[Probe] = probe
    app = App(
        QUEUE,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=ERRORS),
        container=container,
    )
    for saga in sagas or (Tickets,):
        app.register_saga(saga)
    for message_type in (Open, Reply, Close, Remind):
        app.route(message_type, QUEUE)
    return app


def forged(saga: str, saga_id: str | None = None) -> dict[str, str]:
    """Saga headers as another producer might copy or make them up."""
    return {Header.SAGA_TYPE: saga, Header.SAGA_ID: saga_id or str(uuid.uuid4())}


async def test_a_start_message_with_made_up_saga_headers_starts_its_saga() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1"), headers=forged(Tickets.saga_name))
        await app.send(Open("t-2"), headers=forged("someone.Else"))
        await bus.idle()

        assert probe.runs == Counter(open=2)
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1")
        assert await bus.saga_data(Tickets, "t-2") == Ticket("t-2")
    assert bus.dead_lettered == []


async def test_a_correlated_message_with_a_made_up_saga_id_reaches_its_saga() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        await app.send(Reply("t-1"), headers=forged(Tickets.saga_name))
        await app.send(Reply("t-1"), headers=forged(Tickets.saga_name, "x" * 500))
        await bus.idle()

        assert probe.runs["reply"] == 2
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1", replies=2)
    assert bus.dead_lettered == []


async def test_a_correlated_message_with_a_made_up_saga_id_and_no_saga_is_not_found() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Reply("t-9"), headers=forged(Tickets.saga_name))
        await bus.idle()

        assert probe.not_found == [Reply("t-9")]
    assert bus.dead_lettered == []


async def test_another_sagas_id_on_a_correlated_message_is_no_timeout() -> None:
    """The real id of saga t-1 on a Reply that correlates to t-2: the Reply goes to t-2."""
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await app.send(Open("t-2"))
        await bus.idle()
        await app.send(Reply("t-2"), headers=forged(Tickets.saga_name, probe.saga_ids["t-1"]))
        await bus.idle()

        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1")
        assert await bus.saga_data(Tickets, "t-2") == Ticket("t-2", replies=1)
    assert bus.dead_lettered == []


@pytest.mark.parametrize("saga", ["someone.Else", Escalations.saga_name])
async def test_a_saga_type_header_naming_no_saga_taking_the_message_does_not_silence_it(
    saga: str,
) -> None:
    """A Close with a saga-type of an unknown saga, or of one that does not take Close."""
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        await app.send(Close("t-1"), headers=forged(saga, probe.saga_ids["t-1"]))
        await app.send(Close("t-9"), headers=forged(saga))
        await bus.idle()

        assert probe.runs["close"] == 1
        assert await bus.saga_data(Tickets, "t-1") is None
        assert probe.not_found == [Close("t-9")]
    assert bus.dead_lettered == []


async def test_a_made_up_timeout_of_another_saga_does_not_silence_a_correlated_message() -> None:
    """Escalations takes Reply too: headers naming it with a made-up id leave Tickets its Reply."""
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        await app.send(Reply("t-1"), headers=forged(Escalations.saga_name))
        await bus.idle()

        assert probe.runs["reply"] == 1
        assert probe.runs["escalation reply"] == 1  # it starts an Escalations saga, as a Reply
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1", replies=1)
        assert await bus.saga_data(Escalations, "t-1") == Ticket(replies=1)
    assert bus.dead_lettered == []


async def test_a_real_timeout_of_a_correlated_type_reaches_only_its_saga() -> None:
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Reply("t-1"))  # starts an Escalations saga for t-1
        await app.send(Open("t-1", timeout=Reply("t-1")))
        await bus.idle(include_delayed=False)
        assert probe.runs["escalation reply"] == 1
        [deferred] = bus.deferred
        assert deferred.headers[Header.SAGA_TYPE] == Tickets.saga_name

        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["reply"] == 1
        assert probe.runs["escalation reply"] == 1  # Tickets' timeout: not Escalations' Reply
    assert bus.dead_lettered == []


async def test_a_timeout_of_a_correlated_type_whose_saga_ended_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = Probe()
    app = tickets_app(probe)
    caplog.set_level(logging.INFO, logger="mersal.sagas")
    async with Harness(app) as bus:
        await app.send(Open("t-1", timeout=Reply("t-1")))
        await bus.idle(include_delayed=False)
        ended = probe.saga_ids["t-1"]
        await app.send(Close("t-1"))
        await bus.idle(include_delayed=False)

        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["reply"] == 0
        assert probe.not_found == []
    assert bus.dead_lettered == []
    assert f"timeout of saga {ended!r} of Tickets, which has ended: ignored" in caplog.text


async def test_a_new_saga_under_the_same_correlation_does_not_get_an_ended_sagas_timeout() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1", timeout=Reply("t-1")))
        await bus.idle(include_delayed=False)
        await app.send(Close("t-1"))
        await bus.idle(include_delayed=False)
        await app.send(Open("t-1"))  # a new saga, with a new id, under the same value
        await bus.idle(include_delayed=False)
        assert len({deferred.headers[Header.SAGA_ID] for deferred in bus.deferred}) == 1

        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert probe.runs["reply"] == 0
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1")
    assert bus.dead_lettered == []


@pytest.mark.parametrize(
    "headers",
    [
        lambda saga_id: forged(Tickets.saga_name, saga_id),
        lambda saga_id: {
            **forged(Tickets.saga_name, saga_id),
            Header.SAGA_CHECK: saga_check(Escalations.saga_name, saga_id),
        },
    ],
    ids=["without-check", "check-of-another-type"],
)
async def test_a_timeout_type_naming_a_running_saga_without_a_valid_check_runs_on_it(
    headers: Callable[[str], dict[str, str]],
) -> None:
    """A timeout requested before the check existed still reaches the saga that requested it."""
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        await app.send(Remind("t-1"), headers=headers(probe.saga_ids["t-1"]))
        await bus.idle()

        assert probe.runs["remind"] == 1
        assert probe.runs["escalation remind"] == 0
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1", reminded=1)
    assert bus.dead_lettered == []


@pytest.mark.parametrize(
    ("headers", "ended"),
    [
        (lambda saga_id: forged(Tickets.saga_name), False),
        (lambda saga_id: forged(Tickets.saga_name, saga_id), True),
        (
            lambda saga_id: {
                **forged(Tickets.saga_name),
                Header.SAGA_CHECK: saga_check(Escalations.saga_name, saga_id),
            },
            False,
        ),
    ],
    ids=["made-up-id", "ended-saga-without-check", "check-of-another-type"],
)
async def test_a_timeout_type_naming_no_saga_without_a_valid_check_is_dead_lettered(
    headers: Callable[[str], dict[str, str]], ended: bool
) -> None:
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        if ended:
            await app.send(Close("t-1"))
            await bus.idle()
        sent = headers(probe.saga_ids["t-1"])
        await app.send(Remind("t-1"), headers=sent)
        await bus.idle()

        assert probe.runs["remind"] == probe.runs["escalation remind"] == 0
        [dead] = bus.dead_lettered
        assert dead.error_type == "mersal.sagas.UnrequestedTimeout"
        assert dead.error_message == (
            f"Remind names saga {sent[Header.SAGA_ID]!r} of Tickets, which does not exist, "
            "without a valid saga-check: not a timeout this app requested"
        )
        assert dead.headers[Header.ERROR_ATTEMPTS] == "1"  # no retries


async def test_a_timeout_of_a_type_two_sagas_take_reaches_only_the_one_that_requested_it() -> None:
    probe = Probe()
    app = tickets_app(probe, Tickets, Escalations)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        saga_id = probe.saga_ids["t-1"]
        real = {
            **forged(Tickets.saga_name, saga_id),
            Header.SAGA_CHECK: saga_check(Tickets.saga_name, saga_id),
        }
        await app.send(Remind("t-1"), headers=real)
        await bus.idle()

        assert probe.runs["remind"] == 1
        assert probe.runs["escalation remind"] == 0
        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1", reminded=1)
    assert bus.dead_lettered == []


@pytest.mark.parametrize("saga_id", ["", "x" * 10240, "ab\x00cd", "line\nbreak\x1b[31m", "é" * 40])
async def test_odd_saga_ids_reach_logs_and_errors_printable_and_short(
    saga_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe()
    app = tickets_app(probe)
    caplog.set_level(logging.INFO, logger="mersal.sagas")
    headers = {Header.SAGA_TYPE: Tickets.saga_name, Header.SAGA_ID: saga_id}
    checked = {**headers, Header.SAGA_CHECK: saga_check(Tickets.saga_name, saga_id)}
    async with Harness(app) as bus:
        await app.send(Remind("t-1"), headers=checked)  # a real check: ignored, logged
        await app.send(Remind("t-1"), headers=headers)
        await bus.idle()

    [line] = [r.getMessage() for r in caplog.records if "which has ended" in r.getMessage()]
    [dead] = bus.dead_lettered
    for text in (line.split(": timeout of saga ")[1], dead.error_message):
        assert text.isprintable()
        assert len(text) < 160


async def test_a_timeout_type_with_a_saga_type_of_no_registered_saga_goes_to_not_found() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1"))
        await bus.idle()
        await app.send(Remind("t-1"), headers=forged("someone.Else", probe.saga_ids["t-1"]))
        await bus.idle()

        assert probe.runs["remind"] == 0
        assert probe.not_found == [Remind("t-1")]
    assert bus.dead_lettered == []


# request_timeout checks a correlated timeout type's correlation value at the call.


@pytest.mark.parametrize(
    ("timeout", "reason"),
    [
        (Reply(None), "is None: no saga can be found by it"),
        (Reply(""), "is '': no saga can be found by it"),
        (Reply("t-2"), "names another saga than this one ('t-2', this saga's is 't-1')"),
    ],
    ids=["missing", "empty", "another-saga"],
)
async def test_request_timeout_refuses_a_correlation_value_that_would_not_find_this_saga(
    timeout: Reply, reason: str
) -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1", timeout=timeout))
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.error_type == "mersal.errors.MersalError"
        assert dead.error_message.startswith("request_timeout(Reply) in Tickets:")
        assert reason in dead.error_message
        assert "Reply's attribute 'ticket'" in dead.error_message
        assert bus.deferred == []
        assert await bus.saga_data(Tickets, "t-1") is None


async def test_request_timeout_refuses_a_correlation_function_that_raises() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1", nudge=True))
        await bus.idle()

        [dead] = bus.dead_lettered
        assert dead.error_type == "mersal.errors.MersalError"
        assert dead.error_message.startswith("request_timeout(Nudge) in Tickets:")
        assert "raised ValueError" in dead.error_message
        assert "Nudge's correlation function" in dead.error_message
        assert bus.deferred == []


async def test_request_timeout_accepts_its_own_sagas_correlation_value() -> None:
    probe = Probe()
    app = tickets_app(probe)
    async with Harness(app) as bus:
        await app.send(Open("t-1", timeout=Reply("t-1")))
        await bus.idle(include_delayed=False)
        assert bus.deliver_delayed() == 1
        await bus.idle()

        assert await bus.saga_data(Tickets, "t-1") == Ticket("t-1", replies=1)
    assert bus.dead_lettered == []
