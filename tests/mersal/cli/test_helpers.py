"""What the commands share: the app a command names, and the progress line of long jobs.

`--app module:attribute` names an App, a function returning one, or an async function awaited
in a loop of the command's own (opened, not loaded, in a running loop); the progress line of
long replays, drops and purges shows on a terminal only, throttled, and always ends.
"""

from __future__ import annotations

import gc
import io
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from uuid import uuid4

import pytest

from mersal.cli import ProgressLine, load_app, open_app
from mersal.errors import ConfigurationError
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


# The app a command names.


def test_commands_that_read_an_app_await_an_async_factory_in_a_loop_of_their_own(
    async_factory: Callable[[str], str],
) -> None:
    target = async_factory("orders")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app = load_app(target)
    assert (app.name, app.running) == ("orders", False)


def test_an_app_held_by_a_class_in_the_module_is_named_with_a_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"holder_{uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from mersal import App\n\nclass Service:\n    app = App('orders')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)

    assert load_app(f"{module}:Service.app").name == "orders"


async def test_in_a_running_loop_an_async_factory_is_opened_not_loaded(
    async_factory: Callable[[str], str],
) -> None:
    target = async_factory("orders")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigurationError) as raised:
            load_app(target)
        gc.collect()  # a coroutine left unawaited would warn when collected
    assert str(raised.value) == (
        f"{target} is an async function: in a running event loop, "
        f"`await mersal.cli.open_app('{target}')`"
    )
    assert (await open_app(target)).name == "orders"
