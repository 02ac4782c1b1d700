"""Create the shop's tables: `python -m examples.fastapi_orders.schema`.

It applies Mersal's migrations (what `mersal db upgrade` does) and creates the shop's own
tables; a real project would migrate its tables with Alembic.
"""

from __future__ import annotations

import asyncio

from examples.fastapi_orders import settings
from examples.fastapi_orders.db import Base
from mersal_sqlalchemy import make_engine
from mersal_sqlalchemy.cli import upgrade


async def create_tables(database: str) -> None:
    """Create the shop's own tables in `database` where they are missing."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    finally:
        await engine.dispose()


def main() -> None:
    """Migrate the outbox and inbox, then create the shop's tables."""
    database = settings.database()
    upgrade(database)
    asyncio.run(create_tables(database))


if __name__ == "__main__":
    main()
