"""JSON log lines: one object per record, whatever the record holds; message fields kept apart."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import pytest

from mersal import App, RetryPolicy
from mersal.logs import JsonFormatter
from mersal.testing import Harness


def record(message: str, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("mersal.test", logging.WARNING, __file__, 1, message, (), None)
    made.__dict__.update(extra)
    return made


def test_a_lone_surrogate_or_control_character_still_makes_one_valid_line() -> None:
    line = JsonFormatter().format(record("body was \ud800 and \x00 and \n", queue="q\ud800"))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "body was \ud800 and \x00 and \n"
    assert entry["queue"] == "q\ud800"


def test_a_traceback_goes_in_the_error_key() -> None:
    try:
        raise ValueError("broken")
    except ValueError:
        failed = record("handling failed")
        failed.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(failed))
    assert entry["level"] == "WARNING"
    assert entry["error"].startswith("Traceback")
    assert "ValueError: broken" in entry["error"]


@dataclass
class Charge:
    amount: int


async def test_retry_and_dead_letter_lines_carry_the_message_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("billing", retry=RetryPolicy(immediate=1, delayed=[], error_queue="billing.error"))

    async def charge(command: Charge) -> None:
        raise RuntimeError("declined")

    app.register(Charge, charge)
    app.route(Charge, "billing")
    async with Harness(app) as bus:
        message_id = await app.send(Charge(5))
        await bus.idle()
    failures = [r for r in caplog.records if r.name == "mersal.retry"]
    assert [r.levelname for r in failures] == ["WARNING", "ERROR"]
    for found, attempt in zip(failures, (1, 2), strict=True):
        entry = json.loads(JsonFormatter().format(found))
        assert entry["message_id"] == message_id
        assert entry["correlation_id"] == message_id
        assert entry["queue"] == "billing"
        assert entry["attempt"] == attempt
        assert entry["message_type"].endswith("Charge")
