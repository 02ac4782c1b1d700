"""What counts as a number in a setting: never a bool (an int to Python), never NaN."""

from __future__ import annotations

import math


def is_count(value: object, least: int = 0, most: float = math.inf) -> bool:
    """Whether `value` is an int (not a bool) from `least` to `most`."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def is_seconds(value: object, *, zero: bool = True, infinite: bool = False) -> bool:
    """Whether `value` is a number of seconds >= 0 (`zero=False`: > 0), finite unless `infinite`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not (value >= 0 if zero else value > 0):  # NaN is neither
        return False
    return infinite or value < math.inf
