"""Failure groups: one bug's failures in one group whatever their values, different bugs apart."""

from __future__ import annotations

import pytest

from mersal import Header
from mersal.dead_letters import DeadLetter, failing_handler, failure_group, normalized
from mersal.messages import Envelope

SAME_BUG = [
    ("no customer 41", "no customer 7"),
    ("user u123 not found", "user u9 not found"),
    ("no order ord_123", "no order ord_9"),
    ("customer cus_8xKq2 missing", "customer cus_Zq81 missing"),
    ("took 1500ms", "took 20ms"),
    ("body over 10MB", "body over 2MB"),
    ("timeout after 1.5s", "timeout after 30s"),
    ("value 1e-05 too small", "value 3 too small"),
    ("no order 'abc-123'", "no order 'x 9'"),
    ("at 2026-12-04T10:00:00Z", "at 2025-01-01 09:30"),
    (
        "request 3f2504e0-4f89-11d3-9a0c-0305e82c3301 failed",
        "request 9b2e4f1c-aaaa-4bbb-8ccc-0123456789ab failed",
    ),
    ("object at 0x7f3a2c", "object at 0x10ff"),
]

OTHER_BUGS = [
    ("KeyError: 'email'", "KeyError: 'phone'"),
    ("has no attribute 'total'", "has no attribute 'items'"),
    ("no customer 41", "no order 41"),
]


@pytest.mark.parametrize(("one", "other"), SAME_BUG)
def test_messages_that_differ_in_their_values_normalize_alike(one: str, other: str) -> None:
    assert normalized(one) == normalized(other)


@pytest.mark.parametrize(("one", "other"), OTHER_BUGS)
def test_messages_naming_different_keys_or_things_stay_apart(one: str, other: str) -> None:
    assert normalized(one) != normalized(other)


def test_an_apostrophe_in_a_word_opens_no_quote() -> None:
    assert normalized("can't find 'abc'") == "can't find 'abc'"


def traceback_through(*frames: tuple[str, str]) -> str:
    """A traceback that passes the pipeline's dispatch step, then `frames` (path, function)."""
    lines = ["Traceback (most recent call last):"]
    lines.append('  File "/site/mersal/pipeline.py", line 273, in dispatch')
    lines.append("    await handler(message)")
    for path, function in frames:
        lines.append(f'  File "{path}", line 10, in {function}')
        lines.append("    raise LookupError()")
    lines.append("LookupError: no customer 41")
    return "\n".join(lines)


def test_class_handlers_of_different_packages_are_told_apart() -> None:
    one = traceback_through(("/srv/billing/handlers.py", "__call__"))
    other = traceback_through(("/srv/shipping/handlers.py", "__call__"))

    assert failing_handler(one) == "billing/handlers.py:__call__"
    assert failing_handler(other) == "shipping/handlers.py:__call__"


def test_the_frameworks_wrappers_are_not_the_handler() -> None:
    traceback = traceback_through(
        ("/site/mersal/binding.py", "call"),
        ("/site/lagom/container.py", "resolve"),
        ("/srv/billing/handlers.py", "charge"),
        ("/site/httpx/client.py", "send"),
    )

    assert failing_handler(traceback) == "billing/handlers.py:charge"


def letter(type_name: str, traceback: str | None, message: str = "no customer 41") -> DeadLetter:
    """A dead letter of `type_name` that failed with LookupError(`message`)."""
    headers = {
        Header.TYPE: type_name,
        Header.ERROR_TYPE: "builtins.LookupError",
        Header.ERROR_MESSAGE: message,
    }
    if traceback is not None:
        headers[Header.ERROR_TRACEBACK] = traceback
    return DeadLetter(Envelope(headers, b"{}"))


def test_one_bug_in_one_handler_is_one_group_whatever_its_values() -> None:
    traceback = traceback_through(("/srv/billing/handlers.py", "charge"))
    one = failure_group(letter("Charge", traceback, "no customer 41"))
    other = failure_group(letter("Charge", traceback, "no customer 7"))

    assert one == other
    assert one.label == "LookupError: no customer <n> (in billing/handlers.py:charge)"


def test_without_the_handler_in_the_traceback_the_message_type_keeps_groups_apart() -> None:
    cut = '  File "/site/sqlalchemy/engine.py", line 9, in execute\nLookupError: no customer 41'
    ship = failure_group(letter("Ship", cut))
    bill = failure_group(letter("Bill", cut))

    assert ship.key != bill.key
    assert ship.handler is None
    assert ship.label == "LookupError: no customer <n> (on Ship)"
