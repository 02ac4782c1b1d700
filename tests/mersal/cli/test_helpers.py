"""The progress line of long replays, drops and purges: on a terminal only, throttled, ended."""

from __future__ import annotations

import io

import pytest

from mersal.cli import ProgressLine
from tests.support import Terminal


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        """The current time."""
        return self.now


def test_a_long_job_on_a_terminal_shows_a_line_updated_at_most_ten_times_a_second() -> None:
    stream, clock = Terminal(), Clock()
    with ProgressLine("replayed", stream, clock=clock) as progress:
        for done in range(1, 501):
            clock.now = done * 0.004  # 500 items in two seconds
            progress(done, 500)

    text = stream.getvalue()
    updates = text.split("\r")[1:]
    assert updates[0] == "replayed 1/500"
    assert updates[-1] == "replayed 500/500\n"  # the last always shown, the line ended
    assert 20 <= len(updates) <= 22  # two seconds at ten a second, and the last
    assert text.count("\n") == 1


def test_a_short_job_and_a_stream_that_is_no_terminal_get_nothing() -> None:
    short = Terminal()
    with ProgressLine("dropped", short) as progress:
        for done in range(1, 51):
            progress(done, 50)
    assert short.getvalue() == ""

    piped = io.StringIO()
    with ProgressLine("dropped", piped) as progress:
        for done in range(1, 1001):
            progress(done, 1000)
    assert piped.getvalue() == ""


def test_a_job_that_stops_early_still_ends_its_line() -> None:
    stream = Terminal()
    with pytest.raises(RuntimeError), ProgressLine("purged", stream, clock=Clock()) as progress:
        progress(1, 100)
        progress(2, 100)  # within the same tenth of a second: not shown
        raise RuntimeError("the database went away")
    assert stream.getvalue() == "\rpurged 1/100\n"
