"""What a setting accepts as a count or as seconds: never a bool, a string, or NaN."""

import math

import pytest

from mersal.numbers import is_count, is_seconds


@pytest.mark.parametrize(
    ("value", "least", "most", "expected"),
    [
        (0, 0, math.inf, True),
        (5, 1, 5, True),
        (0, 1, math.inf, False),
        (6, 1, 5, False),
        (True, 0, math.inf, False),
        (False, 0, math.inf, False),
        (2.0, 0, math.inf, False),
        ("3", 0, math.inf, False),
        (None, 0, math.inf, False),
    ],
)
def test_a_count_is_an_int_within_its_bounds(
    value: object, least: int, most: float, expected: bool
) -> None:
    assert is_count(value, least, most) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, True),
        (0.5, True),
        (7, True),
        (-1, False),
        (math.inf, False),
        (math.nan, False),
        (True, False),
        ("1", False),
        (None, False),
    ],
)
def test_seconds_are_a_finite_number_from_zero(value: object, expected: bool) -> None:
    assert is_seconds(value) is expected


def test_seconds_above_zero_refuse_zero_and_infinite_ones_take_infinity() -> None:
    assert not is_seconds(0, zero=False)
    assert is_seconds(0.001, zero=False)
    assert not is_seconds(math.inf)
    assert is_seconds(math.inf, infinite=True)
    assert not is_seconds(math.nan, infinite=True)
    assert not is_seconds(-math.inf, infinite=True)
