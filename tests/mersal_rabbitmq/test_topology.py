"""The topology's pure rules: partition routing keys, and a broker that refuses quorum queues."""

import aiormq

from mersal_rabbitmq.topology import partition_routing_key, quorum_refused


def test_a_partition_key_routes_as_itself_or_as_a_digest_when_too_long() -> None:
    assert partition_routing_key("order-17") == "order-17"
    long_key = "é" * 200  # 400 bytes
    digest = partition_routing_key(long_key)
    assert len(digest) == 64 and digest == partition_routing_key(long_key)


def test_a_broker_that_cannot_make_quorum_queues_gets_an_error_naming_the_option() -> None:
    closed = aiormq.exceptions.ConnectionInternalError(
        "INTERNAL_ERROR - Cannot declare a queue 'queue 'orders' in vhost 'shop'' of type "
        "'rabbit_quorum_queue' on node 'rabbit@h1': the corresponding feature flag is disabled"
    )

    refused = quorum_refused("orders", closed)

    assert refused is not None
    assert "queue_type='classic'" in str(refused) and "enable_feature_flag" in str(refused)
    assert quorum_refused("orders", aiormq.exceptions.ConnectionInternalError("other")) is None
