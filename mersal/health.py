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

from mersal.outbox import Relay
from mersal.settle import Failure
from mersal.worker import Worker

MAX_RELAY_LAG = 60.0
"""Seconds the outbox relay may stay behind before the app is not ready."""

LIVE_CHECKS = frozenset({"app", "worker", "relay"})
"""The checks that tell whether an app is alive (the others, whether it is ready)."""


@dataclass(frozen=True)
class Health:
    """Whether the app is alive and ready, and the reason for each check that fails."""

    live: bool
    ready: bool
    checks: dict[str, str] = field(default_factory=dict)

    @property
    def live_checks(self) -> dict[str, str]:
        """The failing checks of liveness alone: name -> reason."""
        return {name: why for name, why in self.checks.items() if name in LIVE_CHECKS}


@dataclass(frozen=True)
class Parts:
    """What an app's health is read from, as it is now."""

    name: str
    running: bool
    worker: Worker | None
    has_storage: bool
    relay: Relay | None
    transport: object


def health_of(parts: Parts, max_relay_lag: float = MAX_RELAY_LAG) -> Health:
    """Every check on the app's parts, summed up."""
    alive = liveness(parts)
    readiness = {**alive, **ready_checks(parts, max_relay_lag)} if parts.running else alive
    return Health(live=not alive, ready=not readiness, checks=readiness)


def liveness(parts: Parts) -> dict[str, str]:
    """The failing liveness checks: name -> reason."""
    if not parts.running:
        return {"app": f"app {parts.name!r} is not running (never started, or stopped)"}
    failing: dict[str, str] = {}
    worker = parts.worker
    if worker is not None and worker.failed is not None:
        failing["worker"] = f"the worker stopped receiving: {Failure.of(worker.failed)}"
    if parts.has_storage and (parts.relay is None or not parts.relay.running):
        failing["relay"] = "the outbox relay is not running"
    return failing


def ready_checks(parts: Parts, max_relay_lag: float) -> dict[str, str]:
    """The failing readiness checks beyond liveness: name -> reason."""
    failing: dict[str, str] = {}
    if not getattr(parts.transport, "connected", True):
        failing["broker"] = "not connected to the broker (reconnecting)"
    relay = parts.relay
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
