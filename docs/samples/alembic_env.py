"""Your Alembic project's env.py: autogenerate leaves Mersal's tables alone."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, MetaData

# --8<-- [start:configure]
from mersal_sqlalchemy.migrations import include_object


def run_on(
    context: Any, connection: Connection, target_metadata: MetaData
) -> None:
    """Configure Alembic on an open connection (the same when offline)."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # autogenerate leaves Mersal's tables alone
        include_object=include_object,
    )
    # --8<-- [end:configure]
