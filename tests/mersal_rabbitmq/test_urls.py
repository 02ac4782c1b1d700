"""Failover URL lists and the options a RabbitMQ URL carries (queue_type, reconnect_interval)."""

import pytest

from mersal import ConfigurationError
from mersal.urls import mask, split_urls
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.connection import nodes_of, take_option

THREE = "amqps://u:p1@h1/vh;amqps://u:p2@h2:5671/vh; amqps://u:p3@h3/vh"


def test_urls_separated_by_semicolons_are_the_nodes_in_order() -> None:
    assert nodes_of(THREE) == [
        "amqps://u:p1@h1/vh",
        "amqps://u:p2@h2:5671/vh",
        "amqps://u:p3@h3/vh",
    ]


@pytest.mark.parametrize(
    ("address", "written"),
    [
        ("amqp://u:p@h1/vh;h2:5672", "amqp://u:***@h1/vh;amqp://u:***@h2:5672/vh"),
        ("amqp://u:p@h1;h2/vh", "amqp://u:***@h1/vh;amqp://u:***@h2/vh"),
        (
            "amqp://h1/vh?heartbeat=5;h2",
            "amqp://h1/vh?heartbeat=5;amqp://h2/vh?heartbeat=5",
        ),
    ],
)
def test_a_node_written_without_its_scheme_is_refused_with_the_urls_to_write(
    address: str, written: str
) -> None:
    with pytest.raises(ConfigurationError, match="each node is a full URL") as refused:
        nodes_of(address)

    assert written in str(refused.value)
    assert ":p@" not in str(refused.value)
    with pytest.raises(ConfigurationError, match="each node is a full URL"):
        RabbitMQTransport(address)


def test_a_vhost_whose_name_holds_a_semicolon_is_written_escaped() -> None:
    assert nodes_of("amqp://h1/a%3Bb;amqp://h2/a%3Bb") == ["amqp://h1/a%3Bb", "amqp://h2/a%3Bb"]


def test_nodes_of_other_vhosts_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"different vhosts \('shop' / 'other'\)"):
        nodes_of("amqp://h1/shop;amqp://h2/other")
    with pytest.raises(ConfigurationError, match="same /vhost"):
        nodes_of("amqp://h1/shop;amqp://h2")
    assert nodes_of("amqp://h1;amqp://h2/;amqp://h3/%2F") == [
        "amqp://h1",
        "amqp://h2/",
        "amqp://h3/%2F",
    ]


def test_plain_and_tls_nodes_in_one_list_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"with TLS \(amqps://.*or to none \(amqp://\)"):
        nodes_of("amqp://h1/vh;amqps://h2/vh")
    with pytest.raises(ConfigurationError, match="is not an amqp:// or amqps:// URL"):
        nodes_of("amqp://h1/vh;http://h2/vh")


def test_nodes_with_other_queue_types_are_refused() -> None:
    for address in (
        "amqp://h1/vh?queue_type=classic;amqp://h2/vh?queue_type=quorum",
        "amqp://h1/vh?queue_type=classic;amqp://h2/vh",
    ):
        with pytest.raises(ConfigurationError, match=r"same \?queue_type=\.\.\., or leave it out"):
            RabbitMQTransport(address)
    same = RabbitMQTransport("amqp://h1/vh?queue_type=classic;amqp://h2/vh?queue_type=classic;")
    assert same.queue_type == "classic"


def test_a_semicolon_not_followed_by_a_url_is_part_of_the_url() -> None:
    assert split_urls("amqp://u:pa;ss@h1/vh") == ["amqp://u:pa;ss@h1/vh"]
    assert nodes_of("amqp://u:pa;ss@h1/vh;amqp://u:pa;ss@h2/vh") == [
        "amqp://u:pa;ss@h1/vh",
        "amqp://u:pa;ss@h2/vh",
    ]


def test_every_password_of_a_list_is_masked() -> None:
    masked = mask("amqp://u:pa;ss@h1/vh;amqp://u:secret@h2/vh")

    assert "pa;ss" not in masked and "secret" not in masked
    assert masked == "amqp://u:***@h1/vh;amqp://u:***@h2/vh"


def test_an_empty_list_and_different_query_options_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="names no broker"):
        nodes_of(" ; ")
    with pytest.raises(ConfigurationError, match="same ones"):
        nodes_of("amqp://h1/?heartbeat=5;amqp://h2/")


def test_a_trailing_semicolon_is_forgiven() -> None:
    assert nodes_of("amqp://h1/vh;") == ["amqp://h1/vh"]
    assert nodes_of("amqp://h1/vh; ") == ["amqp://h1/vh"]
    assert nodes_of("amqp://h1/vh;;amqp://h2/vh") == ["amqp://h1/vh", "amqp://h2/vh"]


def test_queue_type_is_taken_out_of_every_url() -> None:
    address, value = take_option(
        "amqp://h1/vh?queue_type=classic&heartbeat=5;amqp://h2/vh?queue_type=classic&heartbeat=5",
        "queue_type",
    )

    assert value == "classic"
    assert address == "amqp://h1/vh?heartbeat=5;amqp://h2/vh?heartbeat=5"
    assert take_option("amqp://h1/vh", "queue_type") == ("amqp://h1/vh", None)


def test_queues_are_quorum_unless_asked_otherwise() -> None:
    assert RabbitMQTransport("amqp://h1/vh").queue_type == "quorum"
    assert RabbitMQTransport("amqp://h1/vh?queue_type=classic").queue_type == "classic"
    assert RabbitMQTransport("amqp://h/?queue_type=quorum", queue_type="classic").queue_type == (
        "classic"
    )
    with pytest.raises(ConfigurationError, match="'classic' or 'quorum'"):
        RabbitMQTransport("amqp://h1/vh?queue_type=mirrored")


def test_the_same_query_options_in_another_order_or_spelling_are_the_same() -> None:
    nodes = nodes_of("amqp://h1/vh?heartbeat=5&name=a;amqp://h2/vh?name=a&heartbeat=5.0")
    assert len(nodes) == 2
    transport = RabbitMQTransport(
        "amqp://h1/vh?reconnect_interval=2;amqp://h2/vh?reconnect_interval=2.0"
    )
    assert transport._link.pause == 2.0


@pytest.mark.parametrize("interval", ["inf", "1e308", "nan", "0", "-1", "3601"])
def test_a_reconnect_interval_that_is_not_a_sane_number_of_seconds_is_refused(
    interval: str,
) -> None:
    with pytest.raises(ConfigurationError, match="from 0 to 3600"):
        RabbitMQTransport(f"amqp://h1/vh?reconnect_interval={interval}")


def test_a_vhost_with_a_semicolon_among_escaped_ones_is_shown_escaped() -> None:
    with pytest.raises(ConfigurationError, match="write it %3B") as refused:
        nodes_of("amqp://u:p@h1/a%3Bb;amqp://u:p@h2/a;b")
    assert "amqp://u:***@h1/a%3Bb;amqp://u:***@h2/a%3Bb" in str(refused.value)
