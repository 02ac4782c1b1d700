"""`mersal status`: the status of an app (`mersal.status`) as the command line names it.

Exit status: 0 all is well; 1 something needs an operator (messages in the error queue, parked
outbox rows); 2 it could not look (bad arguments, broker or database unreachable, tables or a
queue missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

from mersal.cli.helpers import in_process, load_app, positive_seconds
from mersal.errors import ConfigurationError, MersalError
from mersal.inspection import ERROR, QUEUE
from mersal.plugins import transport_from
from mersal.status import Naming, Status, StatusQuery, distinct_queues, look, query_for
from mersal.transport import Transport
from mersal.urls import mask

DEFAULT_TIMEOUT = 10.0
"""Seconds `mersal status` waits for the broker and the database to answer, by default."""


def add_status_command(commands: argparse._SubParsersAction[Any]) -> None:
    """Add `status` to the `mersal` command's subcommands."""
    status = commands.add_parser(
        "status",
        help="an app's queues, error queue, outbox and inbox; exits 1 when something needs an "
        "operator, 2 when it could not look",
    )
    status.add_argument(
        "--app", default=None, metavar="MODULE:APP", help="the app (its queues and database)"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--transport",
        default=None,
        metavar="URL",
        help="the broker URL (default: the app's, else $MERSAL_TRANSPORT)",
    )
    status.add_argument(
        "--database",
        default=None,
        metavar="URL",
        help="the database URL (default: the app's, else $MERSAL_DATABASE)",
    )
    status.add_argument(
        "--queue",
        action="append",
        default=[],
        metavar="NAME",
        help="a queue to count too (repeatable); its wait queues are counted with it",
    )
    status.add_argument(
        "--error-queue",
        default=None,
        metavar="NAME",
        help="the error queue (default: the app's)",
    )
    status.add_argument(
        "--management",
        default=None,
        metavar="URL",
        help="the RabbitMQ management API, for unacked counts "
        "(default: http://<broker host>:15672 with the broker's user and password)",
    )
    status.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up on a broker or database that does not answer ({DEFAULT_TIMEOUT:g})",
    )
    status.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    """Carry out `mersal status` as parsed by `add_status_command`."""
    query = query_from(args)
    # Adapters' libraries log their failures (aiormq: "error when creating transport"); those
    # reach the user as the one `mersal: ...` line, so unless logging is set up, they go nowhere.
    logging.basicConfig(handlers=[logging.NullHandler()])
    status = asyncio.run(within(args.timeout, query))
    if args.json:
        print(json.dumps(status.as_json(), indent=2))
    else:
        for line in status.lines():
            print(line)
    for reason in status.reasons():
        print(f"mersal: {reason}", file=sys.stderr)
    return status.exit_code


async def within(seconds: float, query: StatusQuery) -> Status:
    """`look(query)`, or a MersalError after `seconds` without an answer."""
    try:
        async with asyncio.timeout(seconds):
            return await look(query)
    except TimeoutError:
        where = [mask(query.transport.address)] if query.transport is not None else []
        where += [mask(query.database)] if query.database is not None else []
        raise MersalError(
            f"no answer within {seconds:g}s from {' or '.join(where)}: is it up? "
            "(--timeout SECONDS to wait longer)"
        ) from None


def query_from(args: argparse.Namespace) -> StatusQuery:
    """The query the command line asks for; a ConfigurationError when it names nothing to see."""
    transport_url = args.transport
    if args.app is not None:
        app = load_app(args.app)
        transport = transport_from(transport_url) if transport_url else app.transport
        query = query_for(
            app,
            transport=transport,
            database=args.database,
            error_queue=args.error_queue,
            queues=args.queue,
            management=args.management,
        )
        own = query.transport is app.transport  # `mersal dlq --app` uses the app's broker
        own_broker = None if own or query.transport is None else query.transport.address
        query.naming = replace(query.naming, app=args.app, transport=own_broker)
    else:
        query = plain_query(args)
    if query.transport is not None:
        refuse_memory(query.transport)
    return query


def plain_query(args: argparse.Namespace) -> StatusQuery:
    """The query without an app: the URLs and queues given, or from the environment."""
    transport_url = args.transport or os.environ.get("MERSAL_TRANSPORT") or None
    database = args.database or os.environ.get("MERSAL_DATABASE") or None
    if transport_url is None and database is None:
        raise ConfigurationError(
            "mersal status needs --app module:app, or --transport URL (with --queue NAME, "
            "--error-queue NAME) and/or --database URL (or MERSAL_TRANSPORT / MERSAL_DATABASE)"
        )
    named = [(name, QUEUE) for name in args.queue]
    if args.error_queue is not None:
        named.append((args.error_queue, ERROR))
    if transport_url is not None and not named:
        raise ConfigurationError(
            f"mersal status --transport {mask(transport_url)!r} needs the queues to count: "
            "--queue NAME (repeatable), --error-queue NAME, or --app module:app"
        )
    return StatusQuery(
        transport=transport_from(transport_url) if transport_url is not None else None,
        queues=distinct_queues(named),
        waits_of=list(args.queue),
        database=database,
        management=args.management,
        naming=Naming(transport=transport_url, database=database),
    )


def refuse_memory(transport: Transport) -> None:
    """A `memory://` broker lives in the process that made it: another cannot see it."""
    if in_process(transport.address):
        raise ConfigurationError(
            f"{mask(transport.address)} is an in-process broker that only its own process sees: "
            "give the broker's URL (--transport amqp://user:password@host/vhost), or call "
            "mersal.status.app_status(app) in that process"
        )
