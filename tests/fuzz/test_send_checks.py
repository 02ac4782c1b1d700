"""The cheap accepts at send time agree with the rules: none passes what its rule refuses."""

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal.transport.limits import (
    DEFAULT_LIMITS,
    HEADER_NAMES,
    RULES,
    Limits,
    plainly_sendable,
    problem_of,
)
from tests.fuzz.rig import EXPLORE

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ODD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab", min_size=100, max_size=300),
    st.text(st.one_of(SURROGATES, st.sampled_from("a\x00é")), min_size=1, max_size=4),
    st.sampled_from(["", "CC", "BCC", "orders\x00", "\ud800", "é" * 200, "1e9", "inf"]),
)
ASCII = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
NASTY = st.sampled_from(["\ud800", "a\udfff", "é" * 70_000, "\x00", 1, None, b"x"])
NASTY_NAMES = st.sampled_from(["orders\x00", "\ud800", "é" * 200, "", "CC", "x" * 300, 7])
ODD_VALUES = st.one_of(NASTY, NASTY, ODD_TEXT, st.integers(), st.binary(max_size=4))
OURS = st.sampled_from(sorted(HEADER_NAMES))
LIMITS = st.one_of(
    st.just(DEFAULT_LIMITS),
    st.builds(Limits, max_header_bytes=st.integers(300, 700)),
    st.builds(
        Limits,
        max_body_bytes=st.integers(0, 64),
        max_header_bytes=st.integers(0, 600),
        max_name_bytes=st.integers(0, 60),
        max_header_name_bytes=st.integers(0, 40),
        reserved_headers=st.frozensets(st.one_of(OURS, ODD_TEXT), max_size=3),
    ),
)


@st.composite
def near_misses(draw: st.DrawFn) -> Outgoing:
    """A message as Mersal sends it, with up to two things changed for the worse."""
    headers: dict[Any, Any] = draw(st.dictionaries(OURS, ASCII, max_size=10))
    address: Any = "orders"
    body: Any = draw(st.binary(max_size=64))
    for change in draw(st.lists(st.integers(0, 5), max_size=2)):
        if change == 0:
            address = draw(st.one_of(NASTY_NAMES, NASTY, ODD_TEXT))
        elif change == 1:
            body = draw(st.one_of(st.text(max_size=8), st.none(), st.binary(min_size=65)))
        elif change == 2 and headers:
            headers[draw(st.sampled_from(list(headers)))] = draw(ODD_VALUES)
        elif change == 3:
            headers[draw(st.one_of(NASTY_NAMES, ODD_TEXT, st.integers()))] = draw(ASCII)
        elif change == 4:
            headers[Header.DELIVER_AT] = draw(ODD_TEXT)
        else:
            headers.update(draw(st.dictionaries(OURS, st.text(min_size=40, max_size=200))))
    return Outgoing(address, Envelope(headers, body), draw(st.booleans()))


@settings(
    max_examples=10_000 if EXPLORE else 1_000, derandomize=not EXPLORE, database=None, deadline=None
)
@given(outgoing=near_misses(), limits=LIMITS)
def test_the_cheap_accepts_never_pass_what_the_rules_refuse(
    outgoing: Outgoing, limits: Limits
) -> None:
    for accepts, problem_in in RULES:
        if accepts(outgoing, limits):
            assert problem_in(outgoing, limits) is None, problem_in.__name__
    every = all(accepts(outgoing, limits) for accepts, _ in RULES)
    assert plainly_sendable(outgoing, limits) == every
    first = next(filter(None, (problem_in(outgoing, limits) for _, problem_in in RULES)), None)
    assert problem_of(outgoing, limits) == first


def test_a_message_as_mersal_sends_it_takes_the_fast_path() -> None:
    headers = {name: "x" * 36 for name in DEFAULT_LIMITS.plain_names - {Header.DELIVER_AT}}
    assert plainly_sendable(Outgoing("orders", Envelope(headers, b"{}")), DEFAULT_LIMITS)
    headers[Header.DELIVER_AT] = "1"
    assert not plainly_sendable(Outgoing("orders", Envelope(headers, b"{}")), DEFAULT_LIMITS)
