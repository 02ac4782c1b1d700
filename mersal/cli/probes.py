"""The HTTP endpoints of `mersal run --health-port`: `/livez`, `/readyz` and `/metrics`.

`/livez` and `/readyz` answer 200 or 503 with a JSON body naming each failing check and its
reason (`app.health()`); `/metrics`, when the app's metrics go to Prometheus (the extra
`mersal-bus[prometheus]`), answers in Prometheus' text format, else 404 with what serves it.
Served by aiohttp (`mersal-bus[health]`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from mersal.errors import ConfigurationError

if TYPE_CHECKING:
    from aiohttp import web

    from mersal.app import App

log = logging.getLogger("mersal.probes")

HEALTH_EXTRA = "pip install 'mersal-bus[health]'"
"""What installs the health endpoints' server (aiohttp)."""
PROMETHEUS_EXTRA = "pip install 'mersal-bus[prometheus]'"
"""What installs `/metrics` (the Prometheus exporter)."""

Metrics = Callable[[], tuple[bytes, str]]
"""Renders the current metrics: the body and its content type."""

Endpoint = Callable[["web.Request"], Awaitable["web.StreamResponse"]]
"""An aiohttp request handler."""


@asynccontextmanager
async def probes(
    app: App, host: str, port: int, max_relay_lag: float, metrics: Metrics | None = None
) -> AsyncIterator[int]:
    """Serve the endpoints on `host:port` while the block runs; yields the port (for port 0)."""
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigurationError(f"--health-port needs aiohttp: {HEALTH_EXTRA}") from None
    server = web.Application()

    def readiness() -> dict[str, str]:
        return app.health(max_relay_lag=max_relay_lag).checks

    server.router.add_get("/livez", _answer(lambda: app.health().live_checks, "live"))
    server.router.add_get("/readyz", _answer(readiness, "ready"))
    unserved: str | None = None
    if metrics is not None:
        server.router.add_get("/metrics", _metrics(metrics))
    else:
        unserved = no_metrics()
        server.router.add_get("/metrics", _unserved(unserved))
    runner = web.AppRunner(server, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as error:
            raise ConfigurationError(
                f"cannot serve the health endpoints on {host}:{port} ({error.strerror or error}): "
                "choose another --health-port"
            ) from None
        bound = _port_of(runner, port)
        if unserved is None:
            log.info("health endpoints on http://%s:%d/livez, /readyz and /metrics", host, bound)
        else:
            log.info(
                "health endpoints on http://%s:%d/livez and /readyz; no /metrics: %s",
                host,
                bound,
                unserved,
            )
        yield bound
    finally:
        await runner.cleanup()


def prometheus_metrics(app: App) -> Metrics | None:
    """`/metrics` for `app` when `mersal-bus[prometheus]` is installed (else None).

    An app not instrumented yet is instrumented here, its metrics going to the OpenTelemetry
    SDK's Prometheus reader (its spans to the global tracer provider); an app instrumented
    already keeps its providers, and `/metrics` shows what reaches prometheus_client's registry.
    """
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
    except ImportError:
        return None
    from mersal.telemetry import instrument

    if app.observer is None:
        instrument(app, meter_provider=MeterProvider(metric_readers=[PrometheusMetricReader()]))

    def render() -> tuple[bytes, str]:
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

    return render


def no_metrics() -> str:
    """Why `/metrics` is not served, and what serves it."""
    try:
        import opentelemetry.exporter.prometheus  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        return f"/metrics needs the prometheus extra, which is not installed: {PROMETHEUS_EXTRA}"
    return (
        "/metrics is served when metrics are given: serve(app, ..., "
        "metrics=prometheus_metrics(app)), as `mersal run --health-port` does"
    )


def _answer(failing: Callable[[], dict[str, str]], which: str) -> Endpoint:
    """An endpoint answering 200 when `failing` names no check, else 503 with the reasons."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        checks = failing()
        body = {which: not checks, "checks": checks}
        return web.Response(
            status=503 if checks else 200,
            text=json.dumps(body, ensure_ascii=False),
            content_type="application/json",
        )

    return answer


def _metrics(metrics: Metrics) -> Endpoint:
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        body, content_type = metrics()
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    return answer


def _unserved(reason: str) -> Endpoint:
    """An endpoint answering 404 with `reason` (what serves it)."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404, text=f"{reason}\n")

    return answer


def _port_of(runner: web.AppRunner, asked: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return asked
