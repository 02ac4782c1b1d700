"""SQL outbox and inbox storage for Mersal (SQLAlchemy): `App(database=...)` uses it."""

from mersal_sqlalchemy.engines import make_engine
from mersal_sqlalchemy.outbox import SqlOutboxStore
from mersal_sqlalchemy.storage import CONNECTION, SESSION, SqlStorage, attach
from mersal_sqlalchemy.tables import (
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    HEAD_REVISION,
    Tables,
    check_identifier,
    inbox_table,
    make_tables,
    outbox_table,
)

__all__ = [
    "CONNECTION",
    "DEFAULT_INBOX",
    "DEFAULT_OUTBOX",
    "HEAD_REVISION",
    "SESSION",
    "SqlOutboxStore",
    "SqlStorage",
    "Tables",
    "attach",
    "check_identifier",
    "inbox_table",
    "make_engine",
    "make_tables",
    "outbox_table",
]
