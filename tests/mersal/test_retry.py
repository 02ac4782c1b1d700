"""RetryPolicy validation and the attempt header."""

import math
from typing import Any

import pytest

from mersal import (
    ConfigurationError,
    Envelope,
    Header,
    RetryPolicy,
)
from mersal.retry import MAX_ATTEMPTS, attempts_made
from mersal.transport.limits import Limits, fit, header_bytes


def test_the_defaults() -> None:
    policy = RetryPolicy()

    assert policy.immediate == 2
    assert policy.delayed == (1.0, 10.0, 60.0)
    assert policy.error_queue == "error"
    assert policy.fail_fast == ()


@pytest.mark.parametrize(
    ("policy", "attempts"),
    [
        (RetryPolicy(), 6),
        (RetryPolicy(immediate=0, delayed=[]), 1),
        (RetryPolicy(immediate=3, delayed=[]), 4),
        (RetryPolicy(immediate=0, delayed=[0.5, 0.5]), 3),
        (RetryPolicy(immediate=2, delayed=[1, 2, 3, 4]), 7),
    ],
)
def test_max_attempts_counts_the_first_immediate_and_delayed_attempts(
    policy: RetryPolicy, attempts: int
) -> None:
    assert policy.max_attempts == attempts


def test_delays_are_copied_so_the_caller_cannot_change_them_later() -> None:
    delays = [1.0, 2.0]
    policy = RetryPolicy(delayed=delays)

    delays.append(3.0)

    assert policy.delayed == (1.0, 2.0)
    assert policy.max_attempts == 5


def test_fail_fast_lists_exception_classes() -> None:
    policy = RetryPolicy(fail_fast=[ValueError, KeyError])  # type: ignore[arg-type]

    assert policy.fail_fast == (ValueError, KeyError)


@pytest.mark.parametrize(
    ("arguments", "mentions"),
    [
        ({"immediate": -1}, "immediate"),
        ({"immediate": 1.5}, "immediate"),
        ({"immediate": "2"}, "immediate"),
        ({"delayed": [1.0, -0.1]}, "delayed"),
        ({"delayed": [-5]}, "delayed"),
        ({"delayed": ["10"]}, "delayed"),
        ({"delayed": [None]}, "delayed"),
        ({"error_queue": ""}, "error_queue"),
        ({"error_queue": None}, "error_queue"),
        ({"fail_fast": (ValueError, "KeyError")}, "fail_fast"),
        ({"fail_fast": (ValueError(),)}, "fail_fast"),
        ({"fail_fast": (int,)}, "fail_fast"),
        ({"fail_fast": "ValueError"}, "fail_fast"),
    ],
)
def test_a_policy_that_cannot_work_is_refused(arguments: dict[str, Any], mentions: str) -> None:
    with pytest.raises(ConfigurationError, match=mentions):
        RetryPolicy(**arguments)


@pytest.mark.parametrize("delay", [math.inf, math.nan])
def test_a_delay_that_is_not_a_finite_number_is_refused(delay: float) -> None:
    with pytest.raises(ConfigurationError, match="delayed"):
        RetryPolicy(delayed=[1.0, delay])


@pytest.mark.parametrize(
    "arguments", [{"fail_fast": ValueError}, {"delayed": 5}], ids=["fail_fast", "delayed"]
)
def test_a_single_value_where_a_list_belongs_is_a_configuration_error(
    arguments: dict[str, Any],
) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**arguments)


def test_a_policy_is_immutable() -> None:
    policy = RetryPolicy()

    with pytest.raises(AttributeError):
        policy.immediate = 5  # type: ignore[misc]


# The attempt header.


def attempt_header(value: str | None) -> Envelope:
    return Envelope({} if value is None else {Header.ATTEMPT: value}, b"")


@pytest.mark.parametrize(
    ("value", "made"),
    [
        (None, 0),
        ("0", 0),
        ("1", 1),
        ("7", 7),
        (" 3 ", 3),
        ("", 0),
        ("garbage", 0),
        ("2.5", 0),
        ("nan", 0),
        ("0x10", 0),
        ("-1", 0),
        ("-99999999999999999999", 0),
        (str(MAX_ATTEMPTS), MAX_ATTEMPTS),
        (str(MAX_ATTEMPTS + 1), MAX_ATTEMPTS),
        ("99999999999999999999999999", MAX_ATTEMPTS),
    ],
)
def test_attempts_made_reads_the_header_defensively(value: str | None, made: int) -> None:
    assert attempts_made(attempt_header(value)) == made


def test_a_header_too_long_for_int_is_read_without_raising() -> None:
    assert attempts_made(attempt_header("9" * 5000)) in (0, MAX_ATTEMPTS)


def test_fit_leaves_small_headers_alone_and_cuts_the_longest_to_fit() -> None:
    small = {"a": "1", "b": "2"}
    assert fit(Envelope(small, b"")).headers == small

    headers = {"type": "t" * 50_000, "note": "n" * 30_000, "id": "m-1", "x" * 2_000: "odd"}
    fitted = fit(Envelope(headers, b""), Limits(max_header_bytes=40_000)).headers

    assert header_bytes(fitted) <= 40_000
    assert fitted["id"] == "m-1"
    assert "x" * 2_000 not in fitted  # an absurd header name is dropped
    assert fitted["type"].startswith("t" * 1_024)
    assert fitted["type"].endswith("[48976 characters cut]")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"immediate": -1}, "immediate"),
        ({"delayed": [1.0, -2.0]}, "delayed"),
        ({"fail_fast": ("ValueError",)}, "exception classes"),
    ],
)
def test_an_invalid_retry_policy_is_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
