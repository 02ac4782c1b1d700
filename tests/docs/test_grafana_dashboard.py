"""docs/grafana/mersal.json: a Grafana dashboard whose queries name only what /metrics shows.

The names are not listed here: each test that needs them scrapes an app of its own, on a memory
broker and a SQLite file, instrumented with the OpenTelemetry Prometheus reader that
`mersal run --health-port` serves (mersal/cli/probes.py), after it sent and handled messages,
retried one and dead-lettered it, and skipped a duplicate, so that every family is there.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mersal import App, Header, RetryPolicy, message
from mersal.telemetry import instrument
from tests.support import eventually

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "mersal.json"

AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
FUNCTIONS = AGGREGATIONS | (
    {"abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min"}
    | {"day_of_month", "day_of_week", "day_of_year", "days_in_month", "hour", "minute"}
    | {"month", "year", "time", "timestamp", "delta", "deriv", "idelta", "increase", "irate"}
    | {"rate", "resets", "predict_linear", "holt_winters", "double_exponential_smoothing"}
    | {"histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile"}
    | {"histogram_stddev", "histogram_stdvar", "histogram_sum", "label_join", "label_replace"}
    | {"exp", "floor", "ln", "log2", "log10", "round", "scalar", "sgn", "sqrt", "vector"}
    | {"sort", "sort_desc", "sort_by_label", "sort_by_label_desc"}
    | {"avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time"}
    | {"quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time"}
    | {"present_over_time", "mad_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh"}
    | {"cos", "cosh", "sin", "sinh", "tan", "tanh", "deg", "rad", "pi"}
)
"""PromQL's aggregations and functions: a name followed by `(` must be one of them."""
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
"""The modifiers whose parenthesised list names labels."""
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})

TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+)
    | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w.]))
    | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<other>\S)
    """,
    re.VERBOSE,
)
"""PromQL's tokens, roughly; a Grafana variable (`$app`, `${datasource}`) is one token."""
LABEL_VALUES = re.compile(
    r"\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>[a-zA-Z_]\w*)\s*\)\s*",
    re.DOTALL,
)
"""A Grafana variable's query of a label's values, of the series `selector` picks if given."""


@dataclass(frozen=True)
class References:
    """What a query names: metrics, labels, functions."""

    metrics: frozenset[str]
    labels: frozenset[str]
    functions: frozenset[str]


def references(expression: str) -> References:
    """What the PromQL `expression` names, read roughly: a name is a label in `{...}` and in
    `by (...)` and the like; a function before `(`; skipped in `[...]`; a metric elsewhere."""
    tokens = [(found.lastgroup, found.group()) for found in TOKEN.finditer(expression)]
    metrics: set[str] = set()
    labels: set[str] = set()
    functions: set[str] = set()
    braces = brackets = 0
    listing = False  # in the parentheses after `by` and the like
    for index, (kind, text) in enumerate(tokens):
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if kind in {"string", "variable", "duration", "number"}:
            continue
        if text in {"{", "}", "[", "]"}:
            braces += {"{": 1, "}": -1}.get(text, 0)
            brackets += {"[": 1, "]": -1}.get(text, 0)
        elif brackets:
            continue
        elif kind == "name" and (braces or listing):
            labels.add(text)
        elif listing and text == ")":
            listing = False
        elif kind == "name" and text.lower() in GROUPING:
            listing = following == "("
            if listing:
                tokens[index + 1] = ("other", "")  # the list's opening parenthesis
        elif kind == "name" and text.lower() in KEYWORDS:
            continue
        elif kind == "name" and (
            following == "(" or (text in AGGREGATIONS and following.lower() in GROUPING)
        ):
            functions.add(text)  # `sum by (le) (...)`: an aggregation before its modifier
        elif kind == "name":
            metrics.add(text)
    return References(frozenset(metrics), frozenset(labels), frozenset(functions))


def query_references(query: str) -> References:
    """What a panel's expression or a variable's query (`label_values(...)` too) names."""
    asked = LABEL_VALUES.fullmatch(query)
    if asked is None:
        return references(query)
    selected = references(asked["selector"] or "")
    return References(selected.metrics, selected.labels | {asked["label"]}, selected.functions)


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The dashboard's panels, those in rows included (not the rows themselves)."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
        else:
            yield panel


def queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """Every PromQL the dashboard runs, as (where, the query): targets' and variables'."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {target.get('refId')}", target.get("expr", "")
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query", "")
        query = query.get("query", "") if isinstance(query, Mapping) else query
        yield f"variable {variable.get('name')!r}", query
        yield f"variable {variable.get('name')!r} definition", variable.get("definition", query)


@dataclass(frozen=True)
class Exposition:
    """What /metrics showed: each family's sample names, and the labels they carry."""

    families: Mapping[str, frozenset[str]]
    labels: frozenset[str]

    @property
    def metrics(self) -> frozenset[str]:
        """The names a query can select: `..._total`, `..._bucket`, gauges' own."""
        return frozenset().union(*self.families.values())

    @classmethod
    def read(cls, text: str) -> Exposition:
        """The exposition in Prometheus' text format `text`."""
        families = list(text_string_to_metric_families(text))
        return cls(
            {
                family.name: frozenset(sample.name for sample in family.samples)
                for family in families
            },
            frozenset(label for family in families for s in family.samples for label in s.labels),
        )


def problems(dashboard: Mapping[str, Any], exposition: Exposition) -> list[str]:
    """What the dashboard's queries name that the exposition lacks, or PromQL does not have."""
    found = []
    for where, query in queries(dashboard):
        named = query_references(query)
        found += [
            f"{where}: no metric {m} on /metrics"
            for m in sorted(named.metrics - exposition.metrics)
        ]
        found += [
            f"{where}: no label {label} on /metrics"
            for label in sorted(named.labels - exposition.labels)
        ]
        found += [f"{where}: {f}() is not PromQL" for f in sorted(named.functions - FUNCTIONS)]
    return found


def dashboard() -> dict[str, Any]:
    """docs/grafana/mersal.json, parsed."""
    parsed: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return parsed


@message("tests.docs.grafana.Order.v1")
@dataclass
class Order:
    number: int


@message("tests.docs.grafana.Refund.v1")
@dataclass
class Refund:
    number: int


class Declined(Exception):
    """What every refund fails with."""


@pytest.fixture
async def exposition(memory_url: str, sqlite_url: str) -> Exposition:
    """What /metrics shows of an app with an outbox that sent, handled, retried, dead-lettered
    and skipped a duplicate: the text of the Prometheus reader `mersal run` serves, with its
    defaults (mersal/cli/probes.py), in a registry of the test's own."""
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    retry = RetryPolicy(immediate=1, delayed=[0.01], error_queue="grafana.error")
    app = App("grafana", transport=memory_url, database=sqlite_url, retry=retry, concurrency=1)
    orders: list[int] = []
    refunds: list[int] = []

    async def order(command: Order) -> None:
        orders.append(command.number)

    async def refund(command: Refund) -> None:
        refunds.append(command.number)
        raise Declined(f"refund {command.number} declined")

    app.register(Order, order)
    app.register(Refund, refund)
    app.route(Order, app.name)
    app.route(Refund, app.name)
    instrument(app, tracer_provider=NoOpTracerProvider(), meter_provider=provider)
    try:
        async with app:
            async with app.transaction():  # through the outbox: its relay measures the backlog
                await app.send(Order(1))
                await app.send(Refund(2))  # tried, tried again at once, later, dead-lettered
            for _ in range(2):  # the inbox skips the second copy
                await app.send_local(Order(3), headers={Header.MESSAGE_ID: "grafana-order-3"})
            await app.send_local(Order(4))  # one at a time: handled after the copies
            await eventually(
                lambda: sorted(orders) == [1, 3, 4] and len(refunds) == 3,
                "the orders handled and the refund's three attempts",
            )
        # stopped: the last attempt's dead letter is counted
        return Exposition.read(generate_latest(registry).decode())
    finally:
        provider.shutdown()


def test_every_panel_has_a_title_and_a_query_on_the_chosen_prometheus() -> None:
    shown = list(panels(dashboard()))
    assert len(shown) >= 9
    for panel in shown:
        assert panel.get("title"), f"a panel without a title: {panel}"
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['title']!r} has no target"
        for target in targets:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r}: a target lacks expr"
        for used in (panel, *targets):
            assert used.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, (
                f"panel {panel['title']!r} must query the data source the dashboard's "
                "variable chooses"
            )


def test_the_dashboard_lets_one_choose_the_prometheus_and_the_apps() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    app = variables["app"]
    assert app["type"] == "query"
    assert app["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert LABEL_VALUES.fullmatch(app["definition"])
    for panel in panels(dashboard()):
        filtered = all("$app" in target["expr"] for target in panel["targets"])
        assert filtered or panel["title"].endswith("(all apps)"), (
            f"panel {panel['title']!r}: filter it by $app, or say (all apps) in its title"
        )


def test_promql_is_read_as_metrics_apart_from_functions_labels_and_durations() -> None:
    read = references(
        'histogram_quantile(0.95, sum by (le, job) (rate(a_seconds_bucket{x=~"(.+:)?($app)"}'
        "[$__rate_interval] offset 1h))) / on(job) group_left b_total + sum(c[5m]) without (y)"
    )
    assert read.metrics == {"a_seconds_bucket", "b_total", "c"}
    assert read.labels == {"le", "job", "x", "y"}
    assert read.functions == {"histogram_quantile", "sum", "rate"}
    variable = query_references("label_values(a_total{x='1'}, y)")
    assert variable.metrics == {"a_total"}
    assert variable.labels == {"x", "y"}


async def test_every_query_names_only_metrics_and_labels_a_real_app_exports(
    exposition: Exposition,
) -> None:
    assert "messaging_process_duration_seconds_bucket" in exposition.metrics  # it did scrape
    assert problems(dashboard(), exposition) == []


async def test_a_query_naming_a_metric_the_app_does_not_export_is_flagged(
    exposition: Exposition,
) -> None:
    bogus = copy.deepcopy(dashboard())
    panel = copy.deepcopy(bogus["panels"][0])
    panel["title"] = "Bogus"
    panel["targets"][0]["expr"] = 'sum(rate(mersal_bogus_total{mersal_app="a"}[5m]))'
    bogus["panels"].append(panel)  # changed in place below
    assert problems(bogus, exposition) == [
        "panel 'Bogus' A: no metric mersal_bogus_total on /metrics"
    ]
    misspelt = 'rate(messaging_client_consumed_messages{mersal_ap="a"}[5m])'
    panel["targets"][0]["expr"] = misspelt  # the family's name: a counter's samples end in _total
    assert problems(bogus, exposition) == [
        "panel 'Bogus' A: no metric messaging_client_consumed_messages on /metrics",
        "panel 'Bogus' A: no label mersal_ap on /metrics",
    ]


async def test_every_family_the_app_exports_has_a_panel(exposition: Exposition) -> None:
    shown = set().union(*(query_references(query).metrics for _, query in queries(dashboard())))
    unshown = [
        family
        for family, samples in sorted(exposition.families.items())
        if family != "target_info" and not samples & shown
    ]
    assert unshown == [], "docs/grafana/mersal.json has no panel for these"
