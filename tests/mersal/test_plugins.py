"""Plugins (mersal/plugins.py): transports by URL or from MERSAL_TRANSPORT, with passwords masked
in what is refused, and a third-party adapter, installed as a distribution with entry points,
working as ours do."""

import asyncio
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from mersal import App, ConfigurationError
from mersal.cli import main
from mersal.plugins import transport_from
from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport
from mersal.urls import mask


@pytest.fixture(autouse=True)
def no_transport_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)


def test_memory_url_gives_a_memory_transport() -> None:
    transport = transport_from("memory://")

    assert isinstance(transport, MemoryTransport)
    assert isinstance(transport, Transport)
    assert transport.name == "default"
    assert transport.address == "memory://"


def test_a_memory_url_names_its_broker() -> None:
    transport = transport_from("memory://billing")

    assert isinstance(transport, MemoryTransport)
    assert transport.name == "billing"


def test_the_scheme_is_case_insensitive() -> None:
    assert isinstance(transport_from("MEMORY://x"), MemoryTransport)


def test_a_transport_object_is_used_as_it_is() -> None:
    transport = MemoryTransport("memory://mine")

    assert transport_from(transport) is transport


def test_no_argument_and_no_environment_gives_the_default_memory_transport() -> None:
    transport = transport_from(None)

    assert isinstance(transport, MemoryTransport)
    assert transport.name == "default"


@pytest.mark.parametrize(
    "url", ["redis://u:secret@h/", "http://guest:secret@localhost:5672/", "kafka://h:9092"]
)
def test_an_unknown_scheme_is_a_configuration_error_with_the_password_masked(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        transport_from(url)

    text = str(raised.value)
    assert "secret" not in text
    assert url.partition("://")[0] in text
    assert "memory://" in text


@pytest.mark.parametrize("url", ["amqp:/u:secret@h/", "u:secret@h"])
def test_a_malformed_url_does_not_leak_its_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        transport_from(url)

    assert "secret" not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("amqp://u:secret@h/", "amqp://u:***@h/"),
        (
            "amqps://guest:secret@rabbit.example:5671/vhost",
            "amqps://guest:***@rabbit.example:5671/vhost",
        ),
        ("amqp://u:p@ss:w@rd@h/", "amqp://u:***@h/"),
        ("amqp://u@h/", "amqp://u@h/"),
        ("amqp://h/", "amqp://h/"),
        ("memory://", "memory://"),
        ("postgresql+asyncpg://app:secret@db/orders", "postgresql+asyncpg://app:***@db/orders"),
    ],
)
def test_mask_hides_only_the_password(url: str, masked: str) -> None:
    assert mask(url) == masked
    assert "secret" not in mask(url)


def test_mersal_transport_is_used_when_no_transport_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MERSAL_TRANSPORT", "memory://from-env")

    transport = transport_from(None)

    assert isinstance(transport, MemoryTransport)
    assert transport.name == "from-env"
    assert App("orders").transport.address == "memory://from-env"


def test_an_explicit_transport_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERSAL_TRANSPORT", "memory://from-env")

    assert transport_from("memory://explicit").address == "memory://explicit"
    assert App("orders", transport="memory://explicit").transport.address == "memory://explicit"


def test_an_empty_mersal_transport_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERSAL_TRANSPORT", "")

    assert transport_from(None).address == "memory://"


def test_a_bad_mersal_transport_is_reported_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERSAL_TRANSPORT", "redis://u:secret@h/")

    with pytest.raises(ConfigurationError) as raised:
        App("orders")

    assert "secret" not in str(raised.value)
    assert "redis://u:***@h/" in str(raised.value)


# A third-party adapter: a transport, a storage and a command from outside Mersal.


ACME = '''
"""A transport, a storage and a command from outside Mersal."""

import argparse

from mersal import ConfigurationError
from mersal.transport.memory import MemoryTransport


class AcmeTransport(MemoryTransport):
    """acme://NAME: an in-process broker of its own, named NAME."""

    def __init__(self, url: str) -> None:
        super().__init__("memory://acme-" + url.partition("://")[2])
        self.url = url


def attach(app):
    raise ConfigurationError(f"the acme storage was asked for {app.name}")


def add_commands(commands) -> None:
    ping = commands.add_parser("acme-ping", help="answer pong")
    ping.set_defaults(handler=lambda args: print("pong") or 0)
'''


ENTRY_POINTS = """
[mersal.transports]
acme = acme_adapter:AcmeTransport

[mersal.storages]
acmedb = acme_adapter:attach

[mersal.commands]
acme = acme_adapter:add_commands
"""


@pytest.fixture
def acme_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The acme adapter as pip would leave it: a module and its dist-info on sys.path."""
    (tmp_path / "acme_adapter.py").write_text(textwrap.dedent(ACME))
    info = tmp_path / "acme_adapter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-adapter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "acme_adapter", raising=False)


@dataclass
class Ping:
    n: int


def install(
    folder: Path, monkeypatch: pytest.MonkeyPatch, name: str, entry_points: str, code: str = ""
) -> None:
    """A distribution `name` on sys.path: its module (if `code`) and its entry points."""
    if code:
        (folder / f"{name}.py").write_text(textwrap.dedent(code))
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)


async def test_a_third_party_transport_is_picked_by_its_url_and_carries_messages(
    acme_installed: None,
) -> None:
    app = App("orders", transport="acme://orders-bus")
    assert type(app.transport).__name__ == "AcmeTransport"
    seen: list[Ping] = []
    done = asyncio.Event()

    async def handle(message: Ping) -> None:
        seen.append(message)
        if len(seen) == 3:
            done.set()

    app.register(Ping, handle)
    app.route(Ping, "orders")
    async with app:
        for n in range(3):
            await app.send(Ping(n))
        await asyncio.wait_for(done.wait(), timeout=5)
    assert seen == [Ping(0), Ping(1), Ping(2)]


async def test_a_third_party_storage_is_asked_for_its_database_urls(
    acme_installed: None,
) -> None:
    app = App("orders", transport="memory://", database="acmedb+driver://host/name")
    with pytest.raises(ConfigurationError, match="the acme storage was asked for orders"):
        await app.start()


def test_a_third_party_command_joins_the_mersal_command(
    acme_installed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["acme-ping"]) == 0
    assert capsys.readouterr().out == "pong\n"


def test_without_the_adapter_its_scheme_is_refused_naming_what_is_known() -> None:
    with pytest.raises(ConfigurationError) as raised:
        transport_from("acme://orders-bus")
    text = str(raised.value)
    assert "'acme://'" in text
    assert "memory://" in text
    assert "amqp://" in text


def test_an_adapter_that_cannot_be_imported_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "broken_adapter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-adapter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mersal.transports]\nbroken = no_such_module:X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigurationError, match="needs no_such_module, which cannot be imported"):
        transport_from("broken://somewhere")


def test_a_broken_command_plugin_is_skipped_with_a_warning_and_the_rest_works(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    install(
        tmp_path,
        monkeypatch,
        "shadowing",
        "[mersal.commands]\nbroken = shadowing:broken\nshadow = shadowing:shadow\n",
        """
        def broken(commands):
            raise RuntimeError("this plugin is broken")

        def shadow(commands):
            commands.add_parser("run")
        """,
    )
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'broken' commands" in text and "this plugin is broken" in text for text in warned)
    assert any("'shadow' commands" in text and "run" in text for text in warned)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "module:attribute naming an App" in capsys.readouterr().out


def test_two_adapters_claiming_one_scheme_are_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path, monkeypatch, "first_acme", "[mersal.transports]\nacme2 = first_acme:T\n")
    install(tmp_path, monkeypatch, "second_acme", "[mersal.transports]\nacme2 = second_acme:T\n")
    with pytest.raises(ConfigurationError, match="2 installed adapters claim 'acme2://'") as raised:
        transport_from("acme2://bus")
    assert "first_acme:T" in str(raised.value) and "second_acme:T" in str(raised.value)


def test_an_adapter_that_fails_to_load_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(
        tmp_path,
        monkeypatch,
        "exploding",
        "[mersal.transports]\nboom = exploding:T\n",
        "raise RuntimeError('no config file')\n",
    )
    with pytest.raises(ConfigurationError, match=r"failed to load .*no config file"):
        transport_from("boom://bus")


@pytest.mark.parametrize("database", ["u:secret@host/orders", "orders.db", "sqlite:/x.db"])
async def test_a_database_that_is_not_a_url_is_refused_as_such(database: str) -> None:
    app = App("orders", transport="memory://", database=database)
    with pytest.raises(ConfigurationError, match="is not a database URL") as raised:
        await app.start()
    assert "secret" not in str(raised.value)


def test_an_unknown_transport_scheme_names_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("a", transport="kafka://x")
    text = str(raised.value)
    assert "kafka://x" in text
    assert "memory://" in text
    assert "amqp://" in text
