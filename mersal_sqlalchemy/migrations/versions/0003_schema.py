"""The schema table: which releases can run on the tables.

Revision ID: mersal_0003
Revises: mersal_0002
Create Date: 2026-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import adopted, droppable, record_compatibility, table_names
from mersal_sqlalchemy.tables import schema_table, schema_table_name

revision: str = "mersal_0003"
down_revision: str | None = "mersal_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
compatible_with: str = "mersal_0001"
"""The oldest revision whose code runs on this one: it only adds a table."""


def upgrade() -> None:
    """Create the schema table unless it exists already, and record this revision in it.

    It follows the inbox's name, so a table of ours that exists belongs to another pair sharing
    the inbox; one with other columns is refused (`adopted`).
    """
    _, inbox = table_names()
    schema = schema_table_name(inbox)
    if not adopted(schema_table(schema, sa.MetaData()), "schema"):
        create_schema(schema)
    record_compatibility(revision, compatible_with)


def downgrade() -> None:
    """Drop the schema table (if it exists and is ours), unless another pair records it.

    When printing the SQL (`--sql`) it cannot look: it is dropped.
    """
    _, inbox = table_names()
    schema = schema_table_name(inbox)
    if droppable(schema_table(schema, sa.MetaData())):
        op.drop_table(schema)


def create_schema(schema: str) -> None:
    """The schema table: one row per revision of ours, with the oldest code that runs on it."""
    op.create_table(
        schema,
        sa.Column("revision", sa.String(32), nullable=False),
        sa.Column("compatible_with", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("revision"),
    )
