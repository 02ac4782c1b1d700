"""Log records that describe a message, and a JSON formatter that keeps their fields apart.

The records of a message's handling (the INFO line per handled message that `mersal run
--log-messages` turns on, and the retry and dead-letter lines) carry the message's fields as
record attributes: `message_id`, `message_type`, `correlation_id`, `queue`, `attempt` and, once
handled, `duration_ms`. `JsonFormatter` writes them as keys of one JSON object per line; the
text format shows what the message says. Bodies are logged only at DEBUG.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from mersal.context import MessageContext
from mersal.messages import Header
from mersal.settle import Outcome, Verdict

MESSAGE_FIELDS = ("message_id", "message_type", "correlation_id", "queue", "attempt", "duration_ms")
"""The record attributes that describe a message, in the order JSON lines show them."""

handled_log = logging.getLogger("mersal.handled")

DONE = {
    Verdict.ACK: "handled",
    Verdict.RETRY_LATER: "will retry later",
    Verdict.DEAD_LETTER: "dead-lettered",
    Verdict.GIVE_BACK: "gave back",
}


def message_fields(context: MessageContext) -> dict[str, Any]:
    """The fields describing the message `context` handles, for a record's `extra=`."""
    headers = context.headers
    return {
        "message_id": headers.get(Header.MESSAGE_ID, ""),
        "message_type": headers.get(Header.TYPE, ""),
        "correlation_id": context.correlation_id,
        "queue": context.queue,
        "attempt": context.attempt,
    }


def log_handled(context: MessageContext, outcome: Outcome, started: float) -> None:
    """One INFO line for a message whose handling ended: how, and in how long."""
    fields = message_fields(context)
    fields["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
    handled_log.info(
        "%s %s (%s) from %r in %.1f ms",
        DONE[outcome.verdict],
        fields["message_type"] or "a message of no type",
        fields["message_id"] or "no id",
        fields["queue"],
        fields["duration_ms"],
        extra=fields,
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the message fields, error."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in MESSAGE_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
