"""Transports by URL or from MERSAL_TRANSPORT, and URLs with passwords masked."""

import pytest

from mersal import App, ConfigurationError
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
