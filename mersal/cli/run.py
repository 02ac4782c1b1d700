"""`mersal run module:app`: an app's worker as a production process.

It waits for the broker and the database at start (`--wait`, with growing pauses, each
logged), then runs until SIGINT or SIGTERM and stops gracefully. Every configuration and
connection error ends it with one `mersal: ...` line and exit status 2; an app that stops
working on its own (its worker or outbox relay ended) ends it with status 1, so that a
supervisor restarts it. Logs are text or JSON lines (`--log-format json`); `--log-messages`
adds an INFO line per handled message; `--health-port` serves `mersal.cli.probes`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from mersal import loop, starting
from mersal.cli.helpers import in_process, open_app, port, positive_int, seconds
from mersal.cli.probes import Metrics, probes, prometheus_metrics
from mersal.health import MAX_RELAY_LAG
from mersal.logs import JsonFormatter
from mersal.urls import mask

if TYPE_CHECKING:
    from mersal.app import App

log = logging.getLogger("mersal.run")

WAIT = 30.0
"""Seconds `mersal run` waits for the broker and the database at start, by default."""
STOP_MARGIN = 10.0
"""Seconds beyond the app's grace period that a stop may take before it is abandoned."""
SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop `mersal run` gracefully (a second one at once)."""
WATCH_INTERVAL = 1.0
"""Seconds between looks at whether the app still works."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The log line of `--log-format text`."""
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The choices of `--log-level`."""


def add_run_command(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `run` to the `mersal` command's subcommands."""
    run = commands.add_parser("run", help="run an app's worker until SIGINT or SIGTERM")
    run.add_argument("target", help="module:attribute naming an App (or a function returning one)")
    run.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LEVELS, help="(default INFO)"
    )
    run.add_argument(
        "--log-format", default="text", choices=("text", "json"), help="log lines (default text)"
    )
    run.add_argument(
        "--log-messages", action="store_true", help="log an INFO line per handled message"
    )
    run.add_argument(
        "--wait",
        type=seconds,
        default=WAIT,
        metavar="SECONDS",
        help=f"wait this long for the broker and the database to answer at start ({WAIT:g})",
    )
    run.add_argument(
        "--concurrency", type=positive_int, metavar="N", help="messages handled at once (the app's)"
    )
    run.add_argument(
        "--health-port",
        type=port,
        metavar="PORT",
        help="serve /livez, /readyz (and /metrics with mersal-bus[prometheus]) on this port",
    )
    run.add_argument("--health-host", default="0.0.0.0", metavar="HOST", help="(default 0.0.0.0)")
    run.add_argument(
        "--max-relay-lag",
        type=seconds,
        default=MAX_RELAY_LAG,
        metavar="SECONDS",
        help=f"not ready while the outbox relay is behind for longer ({MAX_RELAY_LAG:g})",
    )
    run.add_argument(
        "--loop",
        choices=loop.LOOPS,
        default=None,
        help="event loop: uvloop when installed (mersal-bus[fast]), or asyncio's (default: "
        "MERSAL_LOOP, else auto)",
    )
    run.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """`mersal run`: load the app, set it up as the options say, serve it until told to stop."""
    configure_logging(args.log_level, args.log_format)
    return loop.run(serve_target(args), args.loop)


async def serve_target(args: argparse.Namespace) -> int:
    """Load the app in the running loop (awaiting an async factory), set it up, serve it."""
    app = await open_app(args.target)
    warn_if_in_process(app)
    if args.concurrency is not None:
        app.set_concurrency(args.concurrency)
    app.log_messages = args.log_messages
    metrics = prometheus_metrics(app) if args.health_port is not None else None
    return await serve(
        app,
        wait=args.wait,
        health_port=args.health_port,
        health_host=args.health_host,
        max_relay_lag=args.max_relay_lag,
        metrics=metrics,
    )


def warn_if_in_process(app: App) -> None:
    """Warn that an app on `memory://` has a broker no other process reaches."""
    address = app.transport.address
    if in_process(address):
        log.warning(
            "app %r runs on %s, a broker inside this process: no other process reaches it (a "
            "second `mersal run`, a web server or a script on the same URL gets an empty broker "
            "of its own, and their messages never meet); for several processes use RabbitMQ: "
            "MERSAL_TRANSPORT=amqp://user:password@host/vhost",
            app.name,
            mask(address),
        )


def configure_logging(level: str, form: str) -> None:
    """Log to stderr at `level`, as text or as JSON lines (`form`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


async def serve(
    app: App,
    *,
    wait: float = 0.0,
    health_port: int | None = None,
    health_host: str = "0.0.0.0",
    max_relay_lag: float = MAX_RELAY_LAG,
    metrics: Metrics | None = None,
) -> int:
    """Run `app` until SIGINT or SIGTERM (0), or until it stops working on its own (1).

    A second signal ends the process at once; a stop that outlasts the app's grace period by
    `STOP_MARGIN` seconds is abandoned (1). Either way the broker gives unacknowledged
    messages back, and committed outbox rows wait for the next start.
    """
    stopping = asyncio.Event()
    running = asyncio.get_running_loop()
    for signum in SIGNALS:
        running.add_signal_handler(signum, _on_signal, stopping, signum)
    try:
        if not await start_when_reachable(app, wait, stopping):
            return 0
        try:
            async with AsyncExitStack() as stack:
                if health_port is not None:
                    await stack.enter_async_context(
                        probes(app, health_host, health_port, max_relay_lag, metrics)
                    )
                code = await watch(app, stopping)
        finally:
            stopped = await stop_within(app, app.settings.grace_period + STOP_MARGIN)
        return code if stopped else 1
    finally:
        for signum in SIGNALS:
            running.remove_signal_handler(signum)


def _on_signal(stopping: asyncio.Event, signum: int) -> None:
    name = signal.Signals(signum).name
    if not stopping.is_set():
        log.info("%s: stopping gracefully (again to exit at once)", name)
        stopping.set()
        return
    log.error("%s again: exiting at once; the broker gives unfinished messages back", name)
    os._exit(128 + signum)


async def stop_within(app: App, limit: float) -> bool:
    """Stop `app`, giving up after `limit` seconds (a broker or database that does not answer)."""
    try:
        async with asyncio.timeout(limit):
            await app.stop()
    except TimeoutError:
        log.error(
            "app %r did not stop within %gs (the broker or the database does not answer); "
            "leaving it: the broker gives unacknowledged messages back",
            app.name,
            limit,
        )
        return False
    return True


async def start_when_reachable(app: App, wait: float, stopping: asyncio.Event) -> bool:
    """Start `app`, trying again while its broker or database does not answer, up to `wait` s.

    False when told to stop meanwhile; the last `Unreachable` once the time is up.
    """
    return await starting.start_when_reachable(app, wait, stopping, log=log)


async def watch(app: App, stopping: asyncio.Event) -> int:
    """Wait for a stop signal (0), or for the app to stop working on its own (1)."""
    while not await starting.set_within(stopping, WATCH_INTERVAL):
        health = app.health()
        if not health.live:
            reasons = "; ".join(f"{name}: {reason}" for name, reason in health.checks.items())
            log.error(
                "app %r stopped working (%s); exiting so that it is restarted", app.name, reasons
            )
            return 1
    return 0
