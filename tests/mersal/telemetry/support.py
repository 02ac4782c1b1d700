"""In-memory OpenTelemetry for the telemetry tests: the spans ended, the metric points."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer

from mersal import App
from mersal.telemetry import instrument


@dataclass
class Recorder:
    """Providers that keep what they record: spans as they end, metrics when read."""

    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    reader: InMemoryMetricReader = field(default_factory=InMemoryMetricReader)
    tracer_provider: TracerProvider = field(default_factory=TracerProvider)
    meter_provider: MeterProvider = field(init=False)

    def __post_init__(self) -> None:
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def instrument(self, *apps: App) -> None:
        """Instrument every app with these providers."""
        for app in apps:
            instrument(
                app, tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
            )

    @property
    def tracer(self) -> Tracer:
        """A tracer for the test's own spans (an HTTP request, say)."""
        return self.tracer_provider.get_tracer("tests")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """The spans ended so far (those named `name`), in the order they ended."""
        ended = self.exporter.get_finished_spans()
        return [span for span in ended if name is None or span.name == name]

    def span(self, name: str) -> ReadableSpan:
        """The one span named `name`."""
        found = self.spans(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r}: {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        """The names of the spans ended so far."""
        return [span.name for span in self.exporter.get_finished_spans()]

    def points(self, metric: str) -> list[Any]:
        """The data points of `metric` read now (none if it was never recorded)."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for recorded in scope.metrics:
                    if recorded.name == metric:
                        found.extend(recorded.data.data_points)
        return found

    def metric(self, metric: str) -> Any:
        """`metric` itself (name, unit, description, points) as read now."""
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for recorded in scope.metrics:
                    if recorded.name == metric:
                        return recorded
        raise AssertionError(f"no metric {metric!r} was recorded")

    def shutdown(self) -> None:
        """Stop both providers."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def value(points: Sequence[Any], **attributes: object) -> float:
    """The sum of the points (values, or counts for histograms) whose attributes include these."""
    wanted = {key.replace("__", "."): expected for key, expected in attributes.items()}
    total = 0.0
    for point in points:
        if all(point.attributes.get(key) == expected for key, expected in wanted.items()):
            total += point.count if hasattr(point, "count") else point.value
    return total


def trace_id(span: ReadableSpan | Span) -> int:
    """The span's trace id."""
    context = span.get_span_context()
    assert context is not None
    return int(context.trace_id)


def span_id(span: ReadableSpan | Span) -> int:
    """The span's own id."""
    context = span.get_span_context()
    assert context is not None
    return int(context.span_id)


def parent_id(span: ReadableSpan) -> int | None:
    """The id of the span's parent, None for a root span."""
    return span.parent.span_id if span.parent is not None else None


def linked(span: ReadableSpan) -> list[int]:
    """The span ids of the spans `span` links to."""
    return [link.context.span_id for link in span.links]
