"""The dead-letter store.

Revision ID: mersal_0004
Revises: mersal_0003
Create Date: 2026-12-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import adopted, droppable, record_compatibility, table_names
from mersal_sqlalchemy.tables import dead_letters_table, dead_letters_table_name

revision: str = "mersal_0004"
down_revision: str | None = "mersal_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
compatible_with: str = "mersal_0001"
"""The oldest revision whose code runs on this one: it only adds a table."""


def upgrade() -> None:
    """Create the dead-letter table and its indexes unless it exists already, and record this.

    It follows the inbox's name, as the saga table does; one with other columns is refused.
    """
    _, inbox = table_names()
    name = dead_letters_table_name(inbox)
    if not adopted(dead_letters_table(name, sa.MetaData()), "dead-letter"):
        create_dead_letters(name)
    record_compatibility(revision, compatible_with)


def downgrade() -> None:
    """Drop the dead-letter table (if it exists and is ours), unless another pair records it."""
    _, inbox = table_names()
    name = dead_letters_table_name(inbox)
    if droppable(dead_letters_table(name, sa.MetaData())):
        for index in ("app", "group", "key"):
            op.drop_index(f"ix_{name}_{index}", table_name=name)
        op.drop_table(name)


def create_dead_letters(name: str) -> None:
    """The dead-letter table, with the indexes that find a message, a page and a group."""
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        name,
        sa.Column("id", big, nullable=False, autoincrement=True),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("error_queue", sa.Text(), nullable=False),
        sa.Column("source_queue", sa.Text(), nullable=True),
        sa.Column("message_id", sa.Text(), nullable=True),
        sa.Column("type_name", sa.Text(), nullable=True),
        sa.Column("error_type", sa.Text(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("handler", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "ingested_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("group_key", sa.String(64), nullable=False),
        sa.Column("group_label", sa.Text(), nullable=False),
        sa.Column("headers", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolution", sa.String(16), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sqlite_autoincrement=True,
    )
    op.create_index(f"ix_{name}_key", name, ["key"], unique=True)
    op.create_index(f"ix_{name}_group", name, ["app", "group_key", "id"])
    op.create_index(f"ix_{name}_app", name, ["app", "id"])
