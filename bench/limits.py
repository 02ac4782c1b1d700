"""CPU µs per check of a message against the transport's limits, against a bare dict copy.

Every send is checked as the send step checks it (`limits_<kind>_us`) on a typical message as
Mersal sends it (its own eight headers), one with two headers of the user's (`custom`), and a
delayed one (`delayed`); `limits_transport_us` is a transport's look at an unchecked message.
The raw baseline, `raw_dict_copy_us`, copies the typical message's headers (`dict(headers)`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.support import per_call_us
from mersal.messages import Envelope, Header, new_id
from mersal.transport import Outgoing
from mersal.transport.limits import DEFAULT_LIMITS, check_sendable, plainly_sendable, problem_of

CALLS = 200_000

ID = new_id()
TYPICAL = {
    Header.MESSAGE_ID: ID,
    Header.TYPE: "orders.PlaceOrder.v1",
    Header.SENT_AT: f"{time.time():.6f}",
    Header.CONTENT_TYPE: "application/json",
    Header.SOURCE: "orders",
    Header.REPLY_TO: "orders",
    Header.CORRELATION_ID: ID,
    Header.CAUSATION_ID: new_id(),
}
BODY = b'{"order_id":"o-1","amount":9.5}'


async def run() -> dict[str, float | int]:
    """Time the send step's check on each kind of message, and the raw dict copy."""
    figures: dict[str, float | int] = {}
    for kind, outgoing in samples().items():
        if not sendable(outgoing):
            raise AssertionError(f"the {kind} sample is refused")
        figures[f"limits_{kind}_us"] = per_call_us(sendable, outgoing, CALLS)
    figures["limits_transport_us"] = per_call_us(transport_check, samples()["typical"], CALLS)
    figures["raw_dict_copy_us"] = per_call_us(dict, TYPICAL, CALLS)
    figures["limits_typical_ratio_to_raw"] = (
        figures["limits_typical_us"] / figures["raw_dict_copy_us"]
    )
    return figures


def samples() -> dict[str, Outgoing]:
    """The messages checked, by kind."""
    custom = {**TYPICAL, "tenant": "acme", "trace-parent": f"00-{ID.replace('-', '')}-01"}
    delayed = {**TYPICAL, Header.DELIVER_AT: f"{time.time() + 60:.6f}"}
    return {
        "typical": Outgoing("orders", Envelope(dict(TYPICAL), BODY)),
        "custom": Outgoing("orders", Envelope(custom, BODY)),
        "delayed": Outgoing("orders", Envelope(delayed, BODY)),
    }


def sendable(outgoing: Outgoing) -> bool:
    """The send step's check: an `Unsendable` for a message the transport could never carry."""
    if not plainly_sendable(outgoing, DEFAULT_LIMITS):
        check_sendable(outgoing, DEFAULT_LIMITS)
    return True


transport_check: Callable[[Outgoing], str | None] = problem_of
"""A transport's look at a message the app did not check."""
