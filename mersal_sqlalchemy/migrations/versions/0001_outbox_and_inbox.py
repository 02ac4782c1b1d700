"""The outbox and inbox tables.

Revision ID: mersal_0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from mersal_sqlalchemy.migrations import existing, shared, table_names

revision: str = "mersal_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = ("mersal",)
depends_on: str | Sequence[str] | None = None
compatible_with: str = "mersal_0001"
"""The oldest revision whose code runs on this one: itself, the first."""


def upgrade() -> None:
    """Create the outbox and inbox tables and their indexes, each unless it exists already.

    A table that exists belongs to another pair sharing it (an outbox with another inbox).
    """
    outbox, inbox = table_names()
    present = existing(offline=set())
    if outbox not in present:
        create_outbox(outbox)
    if inbox not in present:
        create_inbox(inbox)


def downgrade() -> None:
    """Drop the outbox and inbox tables (those that exist), but not one another pair records.

    When printing the SQL (`--sql`) it cannot look: both are dropped.
    """
    outbox, inbox = table_names()
    present = existing(offline={outbox, inbox}) - set(shared(outbox, inbox))
    if inbox in present:
        op.drop_index(f"ix_{inbox}_handled_at", table_name=inbox)
        op.drop_table(inbox)
    if outbox in present:
        op.drop_index(f"ix_{outbox}_claim", table_name=outbox)
        op.drop_table(outbox)


def create_outbox(outbox: str) -> None:
    """The outbox table and its claim index."""
    op.create_table(
        outbox,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("publish", sa.Boolean(), nullable=False),
        sa.Column("headers", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("parked_reason", sa.Text(), nullable=True),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(
        f"ix_{outbox}_claim",
        outbox,
        ["app", "id"],
        postgresql_where=sa.text("parked_at IS NULL"),
        sqlite_where=sa.text("parked_at IS NULL"),
    )


def create_inbox(inbox: str) -> None:
    """The inbox table and its index for the cleanup."""
    op.create_table(
        inbox,
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column(
            "handled_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("app", "message_id"),
    )
    op.create_index(f"ix_{inbox}_handled_at", inbox, ["handled_at"])
