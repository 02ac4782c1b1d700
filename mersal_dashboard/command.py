"""`mersal dashboard`: serve the dashboard of one or more apps until stopped (Ctrl-C)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from mersal.app import App
from mersal.cli.helpers import load_app, port, positive_seconds
from mersal.errors import ConfigurationError
from mersal.plugins import transport_from
from mersal_dashboard.security import TOKEN_VARIABLE, checked_token

if TYPE_CHECKING:
    from mersal_dashboard.sources import Source

DEFAULT_PORT = 8025
"""The port the dashboard listens on unless told."""


def add_dashboard_command(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `dashboard` to the `mersal` command."""
    dashboard = commands.add_parser(
        "dashboard",
        help="a web page of an app's queues, failed messages (grouped, retried), outbox, sagas",
    )
    dashboard.add_argument(
        "--app",
        action="append",
        default=[],
        metavar="MODULE:APP",
        help="an app to show (repeatable): its broker and database",
    )
    dashboard.add_argument("--name", default=None, help="the app's name, without --app")
    dashboard.add_argument(
        "--transport", default=None, metavar="URL", help="the broker, without --app"
    )
    dashboard.add_argument(
        "--database",
        default=None,
        metavar="URL",
        help="the database (default: the app's, else $MERSAL_DATABASE)",
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (127.0.0.1: this machine only)",
    )
    dashboard.add_argument("--port", type=port, default=DEFAULT_PORT, help=f"({DEFAULT_PORT})")
    dashboard.add_argument(
        "--token",
        default=None,
        help=f"what an operator signs in with to retry and delete (default: ${TOKEN_VARIABLE}); "
        "without one the dashboard is read-only",
    )
    dashboard.add_argument(
        "--read-only", action="store_true", help="change nothing, even with a token"
    )
    dashboard.add_argument(
        "--no-ingest",
        action="store_true",
        help="leave the error queues alone (`mersal failures ingest` fills the store then)",
    )
    dashboard.add_argument(
        "--interval",
        type=positive_seconds,
        default=2.0,
        metavar="SECONDS",
        help="between looks (2)",
    )
    dashboard.add_argument(
        "--management", default=None, metavar="URL", help="the RabbitMQ management API, for rates"
    )
    dashboard.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name it answers for besides the one it listens on (behind a proxy)",
    )
    dashboard.set_defaults(handler=run_dashboard)


def run_dashboard(args: argparse.Namespace) -> int:
    """Carry out `mersal dashboard` as parsed by `add_dashboard_command`."""
    try:
        from mersal_dashboard.server import Dashboard
    except ImportError as error:
        raise ConfigurationError(
            f"mersal dashboard needs its extra ({error.name} is missing): "
            "pip install 'mersal-bus[dashboard]'"
        ) from None
    token = checked_token(args.token or os.environ.get(TOKEN_VARIABLE))
    sources = sources_of(args)
    dashboard = Dashboard(
        sources,
        token=token,
        read_only=args.read_only,
        ingest=not args.no_ingest,
        interval=args.interval,
        allowed_hosts=args.allowed_host,
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signum, stop.set)
        async with dashboard.serving(args.host, args.port) as url:
            mode = "read-only" if not dashboard.guard.actions_allowed else "actions need the token"
            print(f"mersal dashboard on {url} ({mode}); Ctrl-C stops it", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0


def sources_of(args: argparse.Namespace) -> list[Source]:
    """The apps named by --app, or the one made of --name, --transport and --database."""
    from mersal_dashboard.sources import source_of

    if args.app:
        if args.name or args.transport:
            raise ConfigurationError("mersal dashboard takes --app, or --name with --transport")
        return [
            source_of(load_app(target), database=args.database, management=args.management)
            for target in args.app
        ]
    database = args.database or os.environ.get("MERSAL_DATABASE")
    transport = args.transport or os.environ.get("MERSAL_TRANSPORT")
    if not args.name or not (database or transport):
        raise ConfigurationError(
            "mersal dashboard needs --app module:app (repeatable), or --name APP with "
            "--transport URL and/or --database URL"
        )
    broker = transport_from(transport) if transport else None
    app = App(args.name, transport=broker or "memory://", database=database)
    source = source_of(app, management=args.management)
    if broker is None:
        print("mersal: no broker given: the dashboard shows the database only", file=sys.stderr)
        source.transport = None
    return [source]
