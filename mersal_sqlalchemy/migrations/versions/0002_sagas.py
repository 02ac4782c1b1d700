"""The saga table.

Revision ID: mersal_0002
Revises: mersal_0001
Create Date: 2025-06-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import adopted, droppable, table_names
from mersal_sqlalchemy.tables import saga_table, saga_table_name

revision: str = "mersal_0002"
down_revision: str | None = "mersal_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
compatible_with: str = "mersal_0001"
"""The oldest revision whose code runs on this one: it only adds a table."""


def upgrade() -> None:
    """Create the saga table and its index, unless it exists already.

    It follows the inbox's name, so a table of ours that exists belongs to another pair sharing
    the inbox (another outbox with it); one with other columns is refused (`adopted`).
    """
    _, inbox = table_names()
    sagas = saga_table_name(inbox)
    if not adopted(saga_table(sagas, sa.MetaData()), "saga"):
        create_sagas(sagas)


def downgrade() -> None:
    """Drop the saga table (if it exists and is ours), unless another pair records it.

    When printing the SQL (`--sql`) it cannot look: it is dropped.
    """
    _, inbox = table_names()
    sagas = saga_table_name(inbox)
    if droppable(saga_table(sagas, sa.MetaData())):
        op.drop_index(f"ix_{sagas}_id", table_name=sagas)
        op.drop_table(sagas)


def create_sagas(sagas: str) -> None:
    """The saga table and the unique index that finds a saga by its id."""
    op.create_table(
        sagas,
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("saga", sa.String(200), nullable=False),
        sa.Column("correlation", sa.String(255), nullable=False),
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("app", "saga", "correlation"),
    )
    op.create_index(f"ix_{sagas}_id", sagas, ["id"], unique=True)
