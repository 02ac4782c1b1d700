"""Mersal's web dashboard: failed messages grouped and retried, parked outbox rows, sagas.

`mersal dashboard --app module:app` serves it (the extra `mersal-bus[dashboard]`); in a
program, `Dashboard([source_of(app)], token=...).serving(host, port)`.
"""

from mersal_dashboard.server import Dashboard
from mersal_dashboard.sources import Source, source_of

__all__ = ["Dashboard", "Source", "source_of"]
