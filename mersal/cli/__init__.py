"""The `mersal` command: run an app's worker; look at and replay an error queue; adapters' tools.

`mersal run module:app` runs until SIGINT or SIGTERM; `mersal dlq list|show|replay` works on an
error queue through the transport; installed adapters add theirs (`mersal db ...` and
`mersal outbox ...` come with the SQL adapter) through the `mersal.commands` entry points.
"""

# Each sub-command is a module of this package (run, status, dlq) with an `add_*` function that
# adds it to the parser; what adapters' commands use is imported from here (docs/extending.md).

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mersal import plugins
from mersal.cli.dlq import add_dlq_commands
from mersal.cli.helpers import ProgressLine, load_app, open_app, positive_int
from mersal.cli.run import add_run_command
from mersal.cli.status import add_status_command
from mersal.errors import MersalError
from mersal.text import align

__all__ = ["ProgressLine", "align", "load_app", "main", "open_app", "positive_int"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="mersal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_command(commands)
    add_dlq_commands(commands)
    add_status_command(commands)
    plugins.add_commands(commands)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except MersalError as error:
        print(f"mersal: {error}", file=sys.stderr)
        return 2
