"""SQL outbox and inbox storage for Mersal (SQLAlchemy)."""
