"""How an app is doing, for probes: alive (its loops run) and ready (it can do its work).

`app.health()` reads what the app's parts already know (no query, no I/O), so a probe can
call it as often as it likes. Each failing check is named with its reason:

- live: `app` (started, not stopped), `worker` (still receiving), `relay` (the outbox relay's
  loop runs);
- ready: every liveness check, and `broker` (connected now), `outbox` (the relay's last round
  failed, or its batch has taken longer than the threshold: the database or the broker
  refused it or does not answer), `relay_lag` (the relay has been behind, with
  a full batch in hand each time it looked, for longer than the threshold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mersal.settle import Failure

if TYPE_CHECKING:
    from mersal.app import App

MAX_RELAY_LAG = 60.0
"""Seconds the outbox relay may stay behind before the app is not ready."""


@dataclass(frozen=True)
class Health:
    """Whether the app is alive and ready, and the reason for each check that fails."""

    live: bool
    ready: bool
    checks: dict[str, str] = field(default_factory=dict)


def check(app: App, max_relay_lag: float = MAX_RELAY_LAG) -> Health:
    """Run every check on `app` and sum them up."""
    alive = liveness(app)
    readiness = {**alive, **ready_checks(app, max_relay_lag)} if app.running else alive
    return Health(live=not alive, ready=not readiness, checks=readiness)


def liveness(app: App) -> dict[str, str]:
    """The failing liveness checks: name -> reason."""
    if not app.running:
        return {"app": f"app {app.name!r} is not running (never started, or stopped)"}
    failing: dict[str, str] = {}
    worker = app.worker
    if worker is not None and worker.failed is not None:
        failing["worker"] = f"the worker stopped receiving: {Failure.of(worker.failed)}"
    storage = app.storage
    if storage is not None and (storage.relay is None or not storage.relay.running):
        failing["relay"] = "the outbox relay is not running"
    return failing


def ready_checks(app: App, max_relay_lag: float) -> dict[str, str]:
    """The failing readiness checks beyond liveness: name -> reason."""
    failing: dict[str, str] = {}
    if not getattr(app.transport, "connected", True):
        failing["broker"] = "not connected to the broker (reconnecting)"
    relay = app.storage.relay if app.storage is not None else None
    if relay is not None:
        if relay.failing is not None:
            failing["outbox"] = f"the outbox relay's last round failed: {relay.failing}"
        elif relay.batch_time > max_relay_lag:
            failing["outbox"] = (
                f"the outbox relay's batch has taken {relay.batch_time:.0f}s so far: the "
                "database or the broker does not answer"
            )
        if relay.lag > max_relay_lag:
            failing["relay_lag"] = (
                f"the outbox relay has been behind for {relay.lag:.0f}s "
                f"(more than {max_relay_lag:g}s)"
            )
    return failing
