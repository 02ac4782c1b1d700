"""Your Alembic project's env.py: the part that keeps autogenerate off Mersal's tables."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, MetaData

# --8<-- [start:configure]
from mersal_sqlalchemy.migrations import include_object


def run_on(context: Any, connection: Connection, target_metadata: MetaData) -> None:
    """Configure Alembic on an open connection (and the same in run_migrations_offline)."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=include_object,  # autogenerate leaves Mersal's tables alone
    )
    # --8<-- [end:configure]
