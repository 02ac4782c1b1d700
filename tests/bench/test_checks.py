"""The benchmarks' own checks: a figure past its agreed margin fails the run, within it passes."""

from __future__ import annotations

import types

from bench import rabbitmq
from bench.__main__ import checked

FIGURES = {"rabbitmq_cpu_us_per_msg": 300.0, "raw_cpu_us_per_msg": 200.0}


def test_the_round_trip_passes_within_its_cpu_margin_and_fails_past_it() -> None:
    within = {**FIGURES, "rabbitmq_cpu_ratio_to_raw": rabbitmq.MAX_CPU_RATIO}
    past = {**FIGURES, "rabbitmq_cpu_ratio_to_raw": rabbitmq.MAX_CPU_RATIO + 0.01}

    assert checked(rabbitmq, within) is None
    regression = checked(rabbitmq, past)
    assert regression is not None
    assert "raw aio-pika's (300 against 200 us)" in regression


def test_a_benchmark_without_a_check_always_passes() -> None:
    assert checked(types.ModuleType("bench.plain"), {"anything": 1e9}) is None
