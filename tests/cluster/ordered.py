"""The partitioned consumer of the cluster's order test, run as an OS process of its own.

    python -m tests.cluster.ordered --database URL --transport URL

It runs the App "cluster.ordered" with 4 partitions: every `Step(key, seq)` it handles is
written as a row `steps(key, seq, pid)` through the message's AsyncSession, so the row commits
with the inbox row (once per message id) and the table's serial id records the order in which
the steps took effect. Prints READY once it consumes; stops on SIGTERM (`mersal.cli.run.serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, RetryPolicy, message
from mersal.cli.run import serve

QUEUE = "cluster.ordered"
PARTITIONS = 4
STEPS_TABLE = """
CREATE TABLE steps (
    id bigserial PRIMARY KEY,
    key text NOT NULL,
    seq integer NOT NULL,
    pid integer NOT NULL
)
"""


@message("cluster.Step.v1")
@dataclass
class Step:
    """One step of one key's sequence."""

    key: str
    seq: int


class StepHandler:
    """Writes the step in the message's transaction, after a short, random pause."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, step: Step) -> None:
        await asyncio.sleep(random.uniform(0, 0.01))
        await self.session.execute(
            text("INSERT INTO steps (key, seq, pid) VALUES (:key, :seq, :pid)"),
            {"key": step.key, "seq": step.seq, "pid": os.getpid()},
        )


def ordered_app(database: str, transport: str) -> App:
    """The partitioned app."""
    app = App(
        QUEUE,
        transport=transport,
        database=database,
        partitions=PARTITIONS,
        concurrency=8,
        retry=RetryPolicy(error_queue=f"{QUEUE}.error"),
    )
    app.register(Step, StepHandler)
    return app


async def main(database: str, transport: str) -> None:
    """Run the app until SIGTERM, saying READY once it consumes."""
    app = ordered_app(database, transport)
    server = asyncio.create_task(serve(app))
    while not app.running:
        if server.done():
            await server
            return
        await asyncio.sleep(0.01)
    print("READY", flush=True)
    await server


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.ordered", description=__doc__)
    parser.add_argument("--database", required=True)
    parser.add_argument("--transport", required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    asyncio.run(main(arguments.database, arguments.transport))
    sys.exit(0)
