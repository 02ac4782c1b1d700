"""Pipelines: named steps run in order, changed by name, frozen once the app starts."""

from collections.abc import Callable

import pytest

from mersal import ConfigurationError, Pipeline
from mersal.pipeline import Next, Step, add_storage_steps

Calls = list[str]


def recorder(name: str) -> Step[Calls]:
    """A step that notes its name in the context (a list) and calls the rest of the chain."""

    async def step(calls: Calls, next: Next[Calls]) -> None:
        calls.append(name)
        await next(calls)
        calls.append(f"/{name}")

    return step


def pipeline(*names: str) -> Pipeline[Calls]:
    return Pipeline([(name, recorder(name)) for name in names])


async def run(steps: Pipeline[Calls]) -> Calls:
    calls: Calls = []
    await steps.run(calls)
    return [call for call in calls if not call.startswith("/")]


async def test_steps_run_in_order_each_wrapping_the_rest() -> None:
    calls: Calls = []

    await pipeline("a", "b", "c").run(calls)

    assert calls == ["a", "b", "c", "/c", "/b", "/a"]


async def test_an_empty_pipeline_runs() -> None:
    assert await run(Pipeline([])) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda p: p.insert_before("a", "x", recorder("x")), ["x", "a", "b", "c"]),
        (lambda p: p.insert_before("c", "x", recorder("x")), ["a", "b", "x", "c"]),
        (lambda p: p.insert_after("a", "x", recorder("x")), ["a", "x", "b", "c"]),
        (lambda p: p.insert_after("c", "x", recorder("x")), ["a", "b", "c", "x"]),
        (lambda p: p.replace("b", recorder("x")), ["a", "x", "c"]),
        (lambda p: p.remove("b"), ["a", "c"]),
        (lambda p: p.remove("a"), ["b", "c"]),
    ],
)
async def test_changes_by_name_change_the_order_steps_run_in(
    change: Callable[[Pipeline[Calls]], None], expected: Calls
) -> None:
    steps = pipeline("a", "b", "c")

    change(steps)

    assert await run(steps) == expected


async def test_a_replaced_step_keeps_its_name_and_place() -> None:
    steps = pipeline("a", "b", "c")

    steps.replace("b", recorder("x"))
    steps.insert_after("b", "y", recorder("y"))

    assert steps.names == ["a", "b", "y", "c"]
    assert await run(steps) == ["a", "x", "y", "c"]


async def test_several_changes_compose() -> None:
    steps = pipeline("a", "b")

    steps.insert_after("a", "x", recorder("x"))
    steps.insert_before("x", "w", recorder("w"))
    steps.remove("a")
    steps.insert_after("b", "z", recorder("z"))

    assert steps.names == ["w", "x", "b", "z"]
    assert await run(steps) == ["w", "x", "b", "z"]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.insert_before("nope", "x", recorder("x")),
        lambda p: p.insert_after("nope", "x", recorder("x")),
        lambda p: p.replace("nope", recorder("x")),
        lambda p: p.remove("nope"),
    ],
)
def test_an_unknown_anchor_is_refused_listing_the_step_names(
    change: Callable[[Pipeline[Calls]], None],
) -> None:
    steps = pipeline("decode", "dispatch", "ack")

    with pytest.raises(ConfigurationError) as raised:
        change(steps)

    text = str(raised.value)
    assert "'nope'" in text
    assert all(name in text for name in ("decode", "dispatch", "ack"))
    assert steps.names == ["decode", "dispatch", "ack"]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.insert_before("a", "b", recorder("b")),
        lambda p: p.insert_after("b", "b", recorder("b")),
        lambda p: p.insert_after("a", "a", recorder("a")),
    ],
)
def test_a_duplicate_step_name_is_refused(change: Callable[[Pipeline[Calls]], None]) -> None:
    steps = pipeline("a", "b")

    with pytest.raises(ConfigurationError, match=r"'[ab]'"):
        change(steps)

    assert steps.names == ["a", "b"]


def test_a_pipeline_built_with_duplicate_names_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        Pipeline([("a", recorder("a")), ("a", recorder("a"))])


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.insert_before("a", "x", recorder("x")),
        lambda p: p.insert_after("a", "x", recorder("x")),
        lambda p: p.replace("a", recorder("x")),
        lambda p: p.remove("a"),
    ],
)
async def test_changes_after_freeze_are_refused(
    change: Callable[[Pipeline[Calls]], None],
) -> None:
    steps = pipeline("a", "b")
    steps.freeze()

    with pytest.raises(ConfigurationError, match="before the app starts"):
        change(steps)

    assert steps.names == ["a", "b"]
    assert await run(steps) == ["a", "b"]


async def test_running_freezes_the_pipeline() -> None:
    steps = pipeline("a")
    await run(steps)

    with pytest.raises(ConfigurationError):
        steps.remove("a")


async def test_a_frozen_pipeline_runs_again_and_again() -> None:
    steps = pipeline("a", "b")

    assert [await run(steps) for _ in range(3)] == [["a", "b"]] * 3


async def test_a_step_that_does_not_call_next_stops_the_chain() -> None:
    async def stop(calls: Calls, next: Next[Calls]) -> None:
        calls.append("stop")

    steps = pipeline("a", "b", "c")
    steps.replace("b", stop)
    calls: Calls = []

    await steps.run(calls)

    assert calls == ["a", "stop", "/a"]


async def test_an_error_in_a_step_reaches_the_steps_before_it() -> None:
    seen: list[str] = []

    async def guard(calls: Calls, next: Next[Calls]) -> None:
        try:
            await next(calls)
        except ValueError as error:
            seen.append(str(error))

    async def fail(calls: Calls, next: Next[Calls]) -> None:
        raise ValueError("boom")

    steps = Pipeline([("guard", guard), ("fail", fail), ("after", recorder("after"))])
    calls: Calls = []

    await steps.run(calls)

    assert seen == ["boom"]
    assert calls == []


class Steps:
    """A storage's steps, as `add_storage_steps` sees them."""

    async def unit_of_work(self, calls: Calls, next: Next[Calls]) -> None:
        await next(calls)

    async def check_inbox(self, calls: Calls, next: Next[Calls]) -> None:
        await next(calls)


def test_a_storage_s_steps_go_right_after_decode() -> None:
    incoming = pipeline("decode", "activate", "dispatch", "commit")
    add_storage_steps(incoming, Steps())  # type: ignore[arg-type]
    assert incoming.names == [
        "decode",
        "unit_of_work",
        "inbox",
        "activate",
        "dispatch",
        "commit",
    ]


@pytest.mark.parametrize(
    ("names", "complaint"),
    [
        (["activate", "commit"], "keep a step named 'decode'"),
        (["decode", "inbox", "commit"], "already has a step named 'inbox'"),
    ],
)
def test_a_storage_that_cannot_place_its_steps_changes_nothing(
    names: list[str], complaint: str
) -> None:
    incoming = pipeline(*names)
    with pytest.raises(ConfigurationError, match=complaint):
        add_storage_steps(incoming, Steps())  # type: ignore[arg-type]
    assert incoming.names == names
