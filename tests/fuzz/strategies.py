"""Hypothesis strategies for raw deliveries: bodies, type names, content types and headers."""

from __future__ import annotations

import json
import math
import time

from hypothesis import strategies as st

from mersal import Header
from tests.fuzz.corpus import CONTENT_TYPES, HOSTILE_NAMES, NUMBER_LITERALS, nested, order_json
from tests.fuzz.rig import CAP, DOOMED, JSON, ORDER, PROBE, Case, case, order_headers

CONTROL = frozenset(
    {Header.TYPE, Header.CONTENT_TYPE, Header.DELIVER_AT, Header.ATTEMPT, Header.PARTITION_KEY}
)

# Bodies.

_finite = st.floats(allow_nan=False, allow_infinity=False)
_scalars = st.none() | st.booleans() | st.integers() | _finite | st.text(max_size=20)
json_values = st.recursive(
    _scalars | st.floats(),  # NaN and Infinity become the non-standard literals
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
_plain_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)

valid_orders = st.builds(
    lambda order_id, amount, extra: order_json(order_id, amount, **extra),
    st.text(max_size=40),
    _finite | st.integers(-(2**53), 2**53),
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k not in ("order_id", "amount")),
        _plain_values,
        max_size=3,
    ),
)
"""Order bodies a decoder must accept (unknown fields are ignored)."""

_not_a_string = (
    st.none()
    | st.booleans()
    | st.integers()
    | _finite
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
_not_a_number = (
    st.none()
    | st.booleans()
    | st.text(max_size=10)
    | st.lists(_finite, max_size=3)
    | st.dictionaries(st.text(max_size=3), _finite, max_size=2)
    | st.sampled_from([math.nan, math.inf, -math.inf])
)

wrong_fields = st.one_of(
    st.builds(lambda v: order_json(order_id=v), _not_a_string),
    st.builds(lambda v: order_json(amount=v), _not_a_number),
    st.builds(lambda s: json.dumps({"order_id": s}).encode(), st.text(max_size=10)),
    st.builds(lambda a: json.dumps({"amount": a}).encode(), _finite),
    st.just(b"{}"),
    st.builds(
        lambda key: json.dumps({key: "o-1", "amount": 1.0}).encode(),
        st.sampled_from(["Order_id", "orderId", "order-id", "order_id ", "ORDER_ID", ""]),
    ),
    st.builds(lambda v: json.dumps([{"order_id": "o-1", "amount": v}]).encode(), _finite),
    st.builds(lambda v: json.dumps({"order": {"order_id": "o-1", "amount": v}}).encode(), _finite),
)
"""Valid JSON whose fields are missing, misnamed, wrongly typed, or wrapped."""

literals = st.builds(
    lambda literal, where: (
        f'{{"order_id": "o-1", "amount": {literal}}}' if where == "amount" else literal
    ).encode(),
    st.sampled_from(NUMBER_LITERALS),
    st.sampled_from(["amount", "top"]),
)
"""NaN, Infinity, huge and malformed number literals, as the amount or the whole body."""

deep = st.builds(
    lambda depth, kind, where: (
        nested(depth, kind)
        if where == "top"
        else f'{{"order_id": "o-1", "amount": 1, "extra": {nested(depth, kind)}}}'
        if where == "extra"
        else f'{{"order_id": "o-1", "amount": {nested(depth, kind)}}}'
    ).encode(),
    st.integers(1, 50) | st.integers(500, 3_900),  # shallow, and past a recursion limit
    st.sampled_from(["array", "object", "mixed"]),
    st.sampled_from(["top", "extra", "amount"]),
).filter(lambda body: len(body) <= CAP)
"""JSON nested up to thousands of levels, within the size cap."""

garbage_bodies = st.one_of(
    st.binary(max_size=600),
    st.text(max_size=200).map(str.encode),
    json_values.map(lambda value: json.dumps(value).encode()),
    wrong_fields,
    literals,
    deep,
    st.sampled_from([b"", b"\x00", b"null", b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b"{" * 50]),
)
"""Bodies of every kind; the oracle in `verdict` says which must fail."""

over_cap = st.one_of(
    st.binary(min_size=CAP + 1, max_size=CAP + 600),
    st.integers(CAP + 1, 4 * CAP).map(lambda size: order_json().ljust(size)),
    st.integers(CAP + 1, 4 * CAP).map(lambda size: order_json(note="x" * size)),
)
"""Bodies over the cap, valid Orders among them."""

# Type names and content types.

hostile_names = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.text(max_size=60),
    st.text(alphabet=st.sampled_from("._/:\x00 \n\u00e9\u202e\U0001f600aos"), max_size=40),
    st.lists(
        st.sampled_from(["os", "system", "builtins", "eval", "__import__", "subprocess", "", ".."]),
        min_size=1,
        max_size=6,
    ).map(".".join),
    st.integers(256, 200_000).map(lambda n: ("fuzz.Order." * (n // 11 + 1))[:n]),
).filter(lambda name: name not in (ORDER, DOOMED))
"""Type names no app registered, among them names of importable callables."""

wrong_content_types = st.one_of(
    st.sampled_from(CONTENT_TYPES),
    st.text(min_size=1, max_size=40),
).filter(lambda value: not value.strip().lower().startswith(JSON))
"""Content types other than JSON (JSON with parameters or in capitals is left out)."""

# Other headers.

header_names = st.text(min_size=1, max_size=30).filter(
    lambda name: name not in CONTROL and name != PROBE
)
header_values = st.text(max_size=60) | st.integers(1, 300_000).map(lambda n: "v" * n)

attempts = st.one_of(
    st.integers().map(str),
    st.sampled_from(
        ["", " ", "-1", "0", "999999", "9" * 30, "1e9", "NaN", "0x10", "١٢", "²", "1_000", " 7 "]
    ),
    st.text(max_size=12),
)
"""`attempt` header values: negative, huge, non-numeric, unicode digits."""


def _not_in_the_future(value: str) -> bool:
    # The memory transport honours deliver-at when a message is sent (as it should): a future
    # value would delay the delivery itself. Forged future values are tested in
    # tests/mersal/test_header_trust.py.
    try:
        return not float(value) > time.time()
    except ValueError:
        return True


deliver_ats = st.one_of(
    st.sampled_from(["", "nan", "NaN", "-inf", "soon", "0", "-1e300", "1e-300", "\x00"]),
    st.floats(max_value=1e9).map(str),
    st.text(max_size=20),
).filter(_not_in_the_future)
"""`deliver-at` header values that are not in the future: garbage, past, NaN."""

forged_errors = st.fixed_dictionaries(
    {},
    optional={
        Header.ERROR_TYPE: st.sampled_from(["mersal.errors.DecodeError", "builtins.Exception"]),
        Header.ERROR_MESSAGE: st.text(max_size=30),
        Header.ERROR_ATTEMPTS: attempts,
        Header.ERROR_QUEUE: st.text(max_size=10),
        Header.FAILED_AT: st.text(max_size=10),
    },
)

garbage_headers = st.one_of(
    st.dictionaries(header_names, header_values, max_size=12),
    st.integers(0, 2_000).map(lambda n: {f"x-header-{i}": "v" * (i % 9) for i in range(n)}),
)
"""Headers nobody reads: many of them, huge values, odd names."""


@st.composite
def good_orders_with_garbage_headers(draw: st.DrawFn) -> Case:
    """A valid Order whose other headers are garbage: it must be handled normally."""
    headers = draw(garbage_headers)
    headers.update(draw(forged_errors))
    for name, values in ((Header.ATTEMPT, attempts), (Header.DELIVER_AT, deliver_ats)):
        if draw(st.booleans()):
            headers[name] = draw(values)
    others = (Header.MESSAGE_ID, Header.CORRELATION_ID, Header.REPLY_TO, Header.PARTITION_KEY)
    for name in others:
        if draw(st.booleans()):
            headers[name] = draw(header_values)
    headers.update(order_headers())
    if draw(st.booleans()):
        del headers[Header.CONTENT_TYPE]  # a producer that sends no content type
    return case(headers, draw(valid_orders), body_ok=True)


@st.composite
def any_delivery(draw: st.DrawFn) -> Case:
    """A delivery with every part drawn at random; `verdict` says what must become of it."""
    headers = draw(garbage_headers)
    name = draw(st.sampled_from([ORDER, ORDER, None, ""]) | hostile_names)
    if name is not None:
        headers[Header.TYPE] = name
    content_type = draw(st.sampled_from([JSON, JSON, None, ""]) | wrong_content_types)
    if content_type is not None:
        headers[Header.CONTENT_TYPE] = content_type
    if draw(st.booleans()):
        headers[Header.ATTEMPT] = draw(attempts)
    if draw(st.booleans()):
        return case(headers, draw(valid_orders), body_ok=True)
    return case(headers, draw(garbage_bodies | over_cap))
