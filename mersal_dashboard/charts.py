"""The overview's chart: an app's message rates (or queue depths) over the last minutes, as SVG.

The broker's management API gives rates; without it the chart shows what the queues hold.
Points are computed here and drawn by the template: nothing in a chart comes from a message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mersal.inspection import ERROR, INPUT
from mersal_dashboard.sources import Sample

WIDTH = 600
HEIGHT = 140
PAD = 4


@dataclass(frozen=True)
class Series:
    """One line of the chart: its name, its SVG points, its latest value."""

    name: str
    points: str
    last: float


@dataclass(frozen=True)
class Chart:
    """A chart ready to draw: what it shows, its lines, its scale and span."""

    title: str
    unit: str
    series: list[Series]
    top: float
    seconds: float
    width: int = WIDTH
    height: int = HEIGHT


def rate_chart(history: Iterable[Sample]) -> Chart:
    """The chart of the samples: rates when the broker told them, else queue depths."""
    samples = list(history)
    if any(sample.rates for sample in samples):
        return _chart("messages per second", "/s", samples, ("in", "handled", "failed"), _rate)
    return _chart("messages waiting", "", samples, ("input", "error"), _depth)


def _rate(sample: Sample, name: str) -> float:
    return sample.rates.get(name, 0.0)


def _depth(sample: Sample, name: str) -> float:
    role = INPUT if name == "input" else ERROR
    return float(sum(q.ready or 0 for q in sample.queues if q.role == role))


def _chart(
    title: str,
    unit: str,
    samples: list[Sample],
    names: tuple[str, ...],
    read: Callable[[Sample, str], float],
) -> Chart:
    values = {name: [read(sample, name) for sample in samples] for name in names}
    top = max([1.0, *(v for line in values.values() for v in line)])
    start = samples[0].at if samples else 0.0
    span = max(1.0, samples[-1].at - start) if samples else 1.0
    series = [
        Series(
            name,
            _points([s.at - start for s in samples], line, span, top),
            line[-1] if line else 0.0,
        )
        for name, line in values.items()
    ]
    return Chart(title, unit, series, _nice(top), span)


def _points(times: list[float], values: list[float], span: float, top: float) -> str:
    scale_x = (WIDTH - 2 * PAD) / span
    scale_y = (HEIGHT - 2 * PAD) / _nice(top)
    return " ".join(
        f"{PAD + t * scale_x:.1f},{HEIGHT - PAD - v * scale_y:.1f}"
        for t, v in zip(times, values, strict=True)
    )


def _nice(value: float) -> float:
    """The next round number at or above `value` (1, 2, 5 times a power of ten)."""
    step = 1.0
    while step * 10 <= value:
        step *= 10
    for factor in (1, 2, 5, 10):
        if value <= step * factor:
            return step * factor
    return step * 10
