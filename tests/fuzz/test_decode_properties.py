"""Property-based tests of the decode path: raw envelopes of every kind through a running app.

For every example, each bad delivery ends in the error queue exactly once, with a DecodeError
that says why and with its original body and headers; no handler runs for it; nothing is
imported; the good message sent after the batch is handled (the worker keeps going); and the
input queue ends empty with nothing unacknowledged. `tests/fuzz/rig.py` checks all of that.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mersal import Header
from tests.fuzz.corpus import PICKLE_BOMB, order_json, surely_not_an_order
from tests.fuzz.rig import CAP, EITHER, FUZZ, HANDLED, JSON, ORDER, Case, Rig, case, order_headers
from tests.fuzz.strategies import (
    any_delivery,
    deep,
    garbage_bodies,
    good_orders_with_garbage_headers,
    hostile_names,
    literals,
    over_cap,
    valid_orders,
    wrong_content_types,
    wrong_fields,
)


@FUZZ
@given(st.lists(garbage_bodies | literals, min_size=1, max_size=8))
def test_bodies_that_are_not_an_order_go_straight_to_the_error_queue(
    rig: Rig, bodies: list[bytes]
) -> None:
    rig.check([case(order_headers(), body) for body in bodies])


@FUZZ
@given(st.lists(wrong_fields, min_size=1, max_size=8))
def test_valid_json_with_wrong_fields_is_refused_for_its_body(
    rig: Rig, bodies: list[bytes]
) -> None:
    cases = [case(order_headers(), body, body_ok=False) for body in bodies]

    assert all(one.expect == "body" for one in cases)
    rig.check(cases)


@FUZZ
@given(st.lists(deep, min_size=1, max_size=4))
def test_deeply_nested_json_is_decoded_or_refused_never_retried(
    rig: Rig, bodies: list[bytes]
) -> None:
    # The rig fails a delivery that went to a delayed retry (a RecursionError used to).
    rig.check([case(order_headers(), body) for body in bodies])


@FUZZ
@given(st.lists(hostile_names | st.none(), min_size=1, max_size=8), valid_orders)
def test_unknown_missing_and_hostile_type_names_never_import_or_reach_a_handler(
    rig: Rig, names: list[str | None], body: bytes
) -> None:
    cases = []
    for name in names:
        headers = order_headers()
        if name is None:
            del headers[Header.TYPE]
        else:
            headers[Header.TYPE] = name
        cases.append(case(headers, body, body_ok=True))

    assert all(one.expect in ("unknown message type", "no type header") for one in cases)
    rig.check(cases)


@FUZZ
@given(st.lists(wrong_content_types, min_size=1, max_size=8), valid_orders | st.just(PICKLE_BOMB))
def test_content_types_other_than_json_are_refused(
    rig: Rig, content_types: list[str], body: bytes
) -> None:
    cases = [
        case(order_headers(**{Header.CONTENT_TYPE: value}), body, body_ok=True)
        for value in content_types
    ]

    assert all(one.expect == "content type" for one in cases)
    rig.check(cases)


@FUZZ
@given(st.lists(over_cap, min_size=1, max_size=4))
def test_bodies_over_the_cap_are_refused_before_anything_else(
    rig: Rig, bodies: list[bytes]
) -> None:
    hostile = {Header.TYPE: "os.system", Header.CONTENT_TYPE: "application/x-python-pickle"}
    cases = [case(order_headers(), body, body_ok=True) for body in bodies]
    cases += [case(hostile, body) for body in bodies]

    assert all(one.expect == f"over the {CAP}-byte cap" for one in cases)
    rig.check(cases)


def test_a_body_of_exactly_the_cap_is_decoded_and_one_byte_more_is_not(rig: Rig) -> None:
    at_cap = order_json().ljust(CAP)
    over = order_json().ljust(CAP + 1)

    rig.check([case(order_headers(), at_cap, body_ok=True), case(order_headers(), over)])


@FUZZ
@given(st.lists(good_orders_with_garbage_headers(), min_size=1, max_size=6))
def test_garbage_in_other_headers_does_not_stop_a_good_message(rig: Rig, cases: list[Case]) -> None:
    assert all(one.expect == HANDLED for one in cases)
    rig.check(cases)


@FUZZ
@given(st.lists(any_delivery(), min_size=1, max_size=10))
def test_any_mix_of_deliveries_keeps_every_invariant(rig: Rig, cases: list[Case]) -> None:
    rig.check(cases)


@FUZZ
@given(wrong_fields)
def test_the_oracle_calls_every_wrongly_shaped_body_bad(body: bytes) -> None:
    # The strategies above rely on this: a body built to be wrong must be judged wrong.
    assert surely_not_an_order(body)


@FUZZ
@given(valid_orders)
def test_the_oracle_never_calls_a_valid_order_bad(body: bytes) -> None:
    assert not surely_not_an_order(body)


def test_the_verdict_follows_the_order_of_the_decode_checks() -> None:
    over = b"x" * (CAP + 1)
    pickle = {Header.TYPE: "os.system", Header.CONTENT_TYPE: "application/x-python-pickle"}

    assert case(pickle, over).expect == f"over the {CAP}-byte cap"
    assert case({Header.CONTENT_TYPE: "text/plain"}, b"{}").expect == "no type header"
    assert case(pickle, b"{}").expect == "content type"
    assert case({Header.TYPE: "os.system", Header.CONTENT_TYPE: JSON}, b"{}").expect == (
        "unknown message type"
    )
    assert case({Header.TYPE: ORDER}, b"[]").expect == "body"
    assert case({Header.TYPE: ORDER}, order_json(), body_ok=True).expect == HANDLED
    assert case({Header.TYPE: ORDER}, b'{"order_id": "a", "amount": 1, "a": 1, "a": 2}').expect == (
        EITHER
    )
