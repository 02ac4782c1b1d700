"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}
from mersal_sqlalchemy.migrations import existing, shared, table_names

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}


def upgrade() -> None:
    """Apply this revision to the tables named by -x outbox_table / inbox_table.

    Every pair of tables runs it once, and pairs may share a table (one outbox, two inboxes;
    the saga table follows the inbox, `saga_table_name(inbox)`): change a table only if it is
    not changed yet, as 0001 creates only what is not in `existing(offline=set())`, and 0002
    and 0003 only a table that is not `adopted` (one of another's with its name is refused).
    """
    outbox, inbox = table_names()
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    """Undo this revision, leaving the tables `shared(outbox, inbox)` names (as 0001 does)."""
    outbox, inbox = table_names()
    ${downgrades if downgrades else "pass"}
