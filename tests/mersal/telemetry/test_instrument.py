"""`instrument(app)`: once, before the app starts; and the core without OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from mersal import App, ConfigurationError, MersalError, OutgoingContext
from mersal.pipeline import Next
from mersal.telemetry import RABBITMQ_EVENTS_EXCHANGE, instrument
from mersal_rabbitmq.topology import EVENTS
from tests.mersal.telemetry.support import Recorder


def memory_app() -> App:
    """An app on a memory broker of its own."""
    return App(f"orders-{uuid.uuid4().hex[:8]}", transport=f"memory://{uuid.uuid4().hex}")


def test_instrumenting_adds_named_steps_to_both_pipelines(otel: Recorder) -> None:
    app = memory_app()
    otel.instrument(app)
    assert app.observer is not None
    assert app.incoming.names[:2] == ["telemetry", "decode"]
    assert app.outgoing.names == ["headers", "correlation", "telemetry", "serialize", "send"]


def test_instrumenting_twice_is_refused_and_changes_nothing(otel: Recorder) -> None:
    app = memory_app()
    otel.instrument(app)
    incoming, outgoing, telemetry = app.incoming.names, app.outgoing.names, app.observer
    with pytest.raises(ConfigurationError, match="instrumented already"):
        instrument(app)
    assert (app.incoming.names, app.outgoing.names) == (incoming, outgoing)
    assert app.observer is telemetry


async def test_instrumenting_a_running_app_is_refused(otel: Recorder) -> None:
    app = memory_app()
    async with app:
        with pytest.raises(MersalError, match=r"instrument\(app\) before app .* starts"):
            otel.instrument(app)
    assert app.observer is None
    assert "telemetry" not in app.incoming.names


async def test_instrumenting_an_app_that_ran_is_refused(otel: Recorder) -> None:
    app = memory_app()
    async with app:
        pass
    with pytest.raises(MersalError, match="before the app starts"):
        otel.instrument(app)
    assert app.observer is None


def test_a_step_of_the_same_name_is_refused_with_what_to_rename(otel: Recorder) -> None:
    app = memory_app()

    async def mine(context: OutgoingContext, next: Next[OutgoingContext]) -> None:
        await next(context)

    app.outgoing.insert_before("send", "telemetry", mine)
    with pytest.raises(ConfigurationError, match="rename yours"):
        otel.instrument(app)
    assert app.observer is None


def test_the_exchange_a_publish_names_is_the_one_rabbitmq_publishes_on() -> None:
    assert RABBITMQ_EVENTS_EXCHANGE == EVENTS


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a new interpreter of this environment."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_core_runs_and_instrument_says_what_to_install_without_opentelemetry() -> None:
    result = run_python(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the extra were not installed

        import asyncio
        from dataclasses import dataclass
        from mersal import App, MersalError
        from mersal.telemetry import instrument

        @dataclass
        class Ping:
            n: int

        async def main() -> None:
            app = App("ping", transport="memory://no-otel")
            handled = asyncio.Event()

            async def ping(message: Ping) -> None:
                handled.set()

            app.register(Ping, ping)
            try:
                instrument(app)
            except MersalError as error:
                print(error)
            async with app:
                await app.send_local(Ping(1))
                await asyncio.wait_for(handled.wait(), 5)
            print("handled")

        asyncio.run(main())
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "pip install 'mersal-bus[otel]'" in lines[0]
    assert lines[1:] == ["handled"]


def test_the_core_and_its_adapters_do_not_import_opentelemetry() -> None:
    result = run_python(
        """
        import sys
        import mersal, mersal.app, mersal.testing, mersal_rabbitmq, mersal_sqlalchemy
        print(sorted(name for name in sys.modules if name.startswith("opentelemetry")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
