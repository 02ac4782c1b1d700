"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
${imports if imports else ""}
from mersal_sqlalchemy.tables import migration_table_names

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}


def upgrade() -> None:
    """Apply this revision to the tables named by -x outbox_table / inbox_table."""
    outbox, inbox = migration_table_names(context.get_x_argument(as_dictionary=True))
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    """Undo this revision."""
    outbox, inbox = migration_table_names(context.get_x_argument(as_dictionary=True))
    ${downgrades if downgrades else "pass"}
