"""Failover URL lists, the queue_type URL option, partition routing and migration shapes."""

from pathlib import Path

import aiormq
import pytest

from mersal import App, ConfigurationError, Header, OutcomeUnknown, RetryPolicy, Unsendable
from mersal.messages import Envelope
from mersal.transport import Outgoing, partition_queue
from mersal.urls import mask, split_urls
from mersal_rabbitmq import RabbitMQTransport, connection
from mersal_rabbitmq.connection import nodes_of, take_option
from mersal_rabbitmq.migrating import _queues_of, shape_for
from mersal_rabbitmq.publishing import refusal
from mersal_rabbitmq.topology import partition_routing_key, quorum_refused

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


def test_a_partition_key_routes_as_itself_or_as_a_digest_when_too_long() -> None:
    assert partition_routing_key("order-17") == "order-17"
    long_key = "é" * 200  # 400 bytes
    digest = partition_routing_key(long_key)
    assert len(digest) == 64 and digest == partition_routing_key(long_key)


def test_migration_shapes_follow_the_queue_name() -> None:
    wait = shape_for("orders.wait.1000", "quorum").arguments
    assert wait["x-message-ttl"] == 1000
    assert wait["x-dead-letter-routing-key"] == "orders"
    assert wait["x-dead-letter-strategy"] == "at-least-once"
    event_wait = shape_for("mersal.events.shop.Placed.wait.200", "classic").arguments
    assert event_wait["x-dead-letter-exchange"] == "mersal.events"
    assert event_wait["x-dead-letter-routing-key"] == "shop.Placed"
    assert "x-dead-letter-strategy" not in event_wait
    partition = shape_for(partition_queue("orders", 3), "quorum").arguments
    assert partition["x-single-active-consumer"] is True
    assert shape_for("orders.partition.x", "quorum").arguments == {"x-queue-type": "quorum"}


def test_failover_reconnects_through_no_private_name_of_aio_pika() -> None:
    # The connection reconnects by itself over aio-pika's public Connection: an override of a
    # name-mangled method of RobustConnection went silently unused where aio-pika lacked it.
    sources = (Path(connection.__file__).parent).glob("*.py")
    found = {path.name for path in sources if "RobustConnection" in path.read_text()}
    assert found == set()


def test_a_broker_that_cannot_make_quorum_queues_gets_an_error_naming_the_option() -> None:
    closed = aiormq.exceptions.ConnectionInternalError(
        "INTERNAL_ERROR - Cannot declare a queue 'queue 'orders' in vhost 'shop'' of type "
        "'rabbit_quorum_queue' on node 'rabbit@h1': the corresponding feature flag is disabled"
    )

    refused = quorum_refused("orders", closed)

    assert refused is not None
    assert "queue_type='classic'" in str(refused) and "enable_feature_flag" in str(refused)
    assert quorum_refused("orders", aiormq.exceptions.ConnectionInternalError("other")) is None


def test_migrate_moves_an_apps_wait_queues_before_the_queues_they_feed() -> None:
    app = App(
        "orders",
        transport="memory://",
        partitions=2,
        retry=RetryPolicy(delayed=[1.0], error_queue="orders.error"),
    )

    names = _queues_of(app)

    assert names == [
        "orders.wait.1000",
        "orders.partition.0.wait.1000",
        "orders.partition.1.wait.1000",
        "orders.partition.0",
        "orders.partition.1",
        "orders",
        "orders.error",
    ]


def refused_publish(text: str) -> OutcomeUnknown:
    """A publish whose channel RabbitMQ closed with a 406 saying `text`."""
    try:
        raise OutcomeUnknown("lost its channel") from aiormq.exceptions.ChannelPreconditionFailed(
            text
        )
    except OutcomeUnknown as error:
        return error


def test_a_keyed_send_through_a_node_without_the_hash_plugin_is_kept_with_the_plugin_hint() -> None:
    outgoing = Outgoing("orders", Envelope({Header.PARTITION_KEY: "k"}, b"{}"))
    refused = refused_publish(
        "PRECONDITION_FAILED - Cannot route message through exchange 'orders.partitions' in "
        "vhost 'shop': exchange type x-consistent-hash not found"
    )

    error = refusal(outgoing, refused)

    assert isinstance(error, ConfigurationError) and not isinstance(error, Unsendable)
    assert "rabbitmq-plugins enable rabbitmq_consistent_hash_exchange" in str(error)
    other = refusal(outgoing, refused_publish("PRECONDITION_FAILED - message size 9 is larger"))
    assert isinstance(other, Unsendable) and "rabbitmq-plugins" not in str(other)


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
