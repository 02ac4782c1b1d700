"""Run the benchmarks: `python -m bench [--only NAME] [--runs N]`.

Prints one `key=value` line per figure: its median over the runs, then (with more than one
run) `key_min=` and `key_max=`. Runs on uvloop when it is installed (`uvloop=1`);
`MERSAL_LOOP=asyncio` measures on asyncio's own loop (`uvloop=0`).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from mersal import loop

Figures = dict[str, float | int]
Run = Callable[[], Coroutine[Any, Any, Figures]]

BENCHMARKS: dict[str, str] = {
    "inmemory": "bench.inmemory",
    "codec": "bench.codec",
    "limits": "bench.limits",
    "rabbitmq": "bench.rabbitmq",
    "outbox": "bench.outbox",
    "sqlite": "bench.sqlite",
    "scaleout": "bench.scaleout",
    "amqp10": "bench.amqp10",
    "dead_letters": "bench.dead_letters",
    "sagas": "bench.sagas",
}
"""Every benchmark by name: a module with `async def run() -> dict[str, float | int]`.

A module may also have `def check(medians: dict[str, float | int]) -> str | None`: told the
medians of its figures, it says what regressed past its agreed margin (the run then exits 1).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected benchmarks and print the median of each figure over the runs."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only this benchmark (repeatable or comma separated): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--runs", type=int, default=5, metavar="N", help="runs per benchmark (default 5)"
    )
    args = parser.parse_args(argv)
    names = selected(args.only)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(
            f"unknown benchmark(s) {', '.join(unknown)}; the benchmarks are: "
            f"{', '.join(BENCHMARKS)}"
        )
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: run each benchmark at least once")
    failed = []
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        run = cast(Run, module.run)
        results = [measure(run) for _ in range(args.runs)]
        medians: Figures = {}
        for key, values in collect(results).items():
            medians[key] = statistics.median(values)
            print(f"{key}={format_value(medians[key])}", flush=True)
            if len(values) > 1:
                print(f"{key}_min={format_value(min(values))}")
                print(f"{key}_max={format_value(max(values))}", flush=True)
        regression = checked(module, medians)
        if regression is not None:
            print(f"check_failed={name}", flush=True)
            print(f"python -m bench: {name}: {regression}", file=sys.stderr, flush=True)
            failed.append(name)
    return 1 if failed else 0


def checked(module: object, medians: Figures) -> str | None:
    """What the benchmark's own check says of its medians (None: all within their margins)."""
    check = cast(Callable[[Figures], str | None] | None, getattr(module, "check", None))
    return None if check is None else check(medians)


def selected(only: list[str]) -> list[str]:
    """The benchmark names asked for, in order and without repeats; all when none were."""
    names = [name.strip() for value in only for name in value.split(",") if name.strip()]
    return list(dict.fromkeys(names)) if names else list(BENCHMARKS)


def measure(run: Run) -> Figures:
    """One run of a benchmark in a fresh event loop (see `mersal.loop`), after a collection."""
    gc.collect()
    return {**loop.run(run()), "uvloop": int(loop.chosen() == "uvloop")}


def collect(results: list[Figures]) -> dict[str, list[float | int]]:
    """Each figure's values over the runs, keys in the order the benchmark reported them."""
    values: dict[str, list[float | int]] = {}
    for figures in results:
        for key, value in figures.items():
            values.setdefault(key, []).append(value)
    return values


def format_value(value: float | int) -> str:
    """A figure for printing: whole numbers as ints, large rates rounded, small ones to 4 digits."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


if __name__ == "__main__":
    sys.exit(main())
