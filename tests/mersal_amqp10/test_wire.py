"""Envelopes to and from AMQP 1.0 messages, no broker: what `encode` writes, `decode` reads."""

from __future__ import annotations

import struct
import uuid

import proton
import pytest

from mersal import Envelope, Header
from mersal_amqp10.consuming import _read
from mersal_amqp10.wire import UNREADABLE, decode, encode
from tests.mersal_amqp10.support import amqp_decoded


def sent(body: bytes = b'{"a":1}', **headers: str) -> Envelope:
    """An envelope with the headers the outgoing steps give every message, and `headers`."""
    base = {
        Header.MESSAGE_ID: "m-1",
        Header.TYPE: "tests.Thing.v1",
        Header.CORRELATION_ID: "c-1",
        Header.REPLY_TO: "replies",
        Header.CONTENT_TYPE: "application/json",
        Header.SENT_AT: "1700000000.250000",
    }
    return Envelope({**base, **headers}, body)


def as_proton(encoded: bytes) -> proton.Message:
    """The AMQP 1.0 message in `encoded`, as proton reads it."""
    message = proton.Message()
    message.decode(encoded)
    return message


def delivered(message: proton.Message) -> bytes:
    """`message` encoded as a broker hands it on: acquired for the first time."""
    message.first_acquirer = True
    return bytes(message.encode())


def test_headers_and_body_survive_encode_and_decode() -> None:
    envelope = sent(
        "bödy ✓".encode(),
        **{"x-unicode": "ünïcødé ✓ 日本語 🚀", "x-empty": "", "x-big": "é" * 100_000, "ключ": "v"},
    )

    received = decode(encode(envelope))

    assert received.envelope == envelope


def test_the_well_known_headers_are_mirrored_to_the_standard_properties() -> None:
    message = as_proton(encode(sent()))

    assert message.id == "m-1"
    assert message.correlation_id == "c-1"
    assert message.reply_to == "replies"
    assert message.content_type == "application/json"
    assert message.subject == "tests.Thing.v1"
    assert message.creation_time == pytest.approx(1700000000.25)
    assert message.durable is True
    assert message.properties[Header.TYPE] == "tests.Thing.v1"
    assert bytes(message.body) == b'{"a":1}'


def test_the_body_travels_in_one_data_section() -> None:
    message = as_proton(encode(sent(b"\x00\x01 raw")))

    assert message.inferred is True  # a data section, not an amqp-value one
    assert bytes(message.body) == b"\x00\x01 raw"


def test_an_empty_body_stays_empty_and_readable() -> None:
    received = decode(encode(Envelope({Header.MESSAGE_ID: "m-0"}, b"")))

    assert received.envelope == Envelope({Header.MESSAGE_ID: "m-0"}, b"")


def test_empty_or_unreadable_well_known_headers_are_not_mirrored() -> None:
    envelope = sent(**{Header.REPLY_TO: "", Header.SENT_AT: "soon"})

    message = as_proton(encode(envelope))

    assert message.reply_to is None
    assert not message.creation_time
    assert decode(encode(envelope)).envelope == envelope


def test_a_sent_at_past_the_year_9999_is_not_mirrored() -> None:
    message = as_proton(encode(sent(**{Header.SENT_AT: "253402300800"})))

    assert not message.creation_time


def test_a_message_with_only_standard_properties_becomes_an_envelope() -> None:
    foreign = proton.Message(
        body=b'{"a":1}',
        id="f-1",
        correlation_id="fc-1",
        reply_to="their.replies",
        content_type="application/json",
        subject="orders.Placed.v1",
        creation_time=1700000000.5,
    )

    received = decode(delivered(foreign))

    assert received.envelope.headers == {
        Header.MESSAGE_ID: "f-1",
        Header.CORRELATION_ID: "fc-1",
        Header.REPLY_TO: "their.replies",
        Header.CONTENT_TYPE: "application/json",
        Header.TYPE: "orders.Placed.v1",
        Header.SENT_AT: "1700000000.500000",
    }
    assert received.envelope.body == b'{"a":1}'


def test_application_properties_win_over_the_standard_properties() -> None:
    message = proton.Message(
        body=b"{}",
        id="standard-id",
        subject="standard.Type",
        properties={Header.MESSAGE_ID: "our-id", Header.TYPE: "our.Type"},
    )

    headers = decode(delivered(message)).envelope.headers

    assert headers[Header.MESSAGE_ID] == "our-id"
    assert headers[Header.TYPE] == "our.Type"


def test_a_uuid_message_id_reads_as_its_canonical_text() -> None:
    message_id = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")

    headers = decode(delivered(proton.Message(body=b"{}", id=message_id))).envelope.headers

    assert headers[Header.MESSAGE_ID] == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"


def test_a_message_without_a_content_type_gets_none() -> None:
    headers = decode(delivered(proton.Message(body=b"{}", id="m-2"))).envelope.headers

    assert Header.CONTENT_TYPE not in headers
    assert headers == {Header.MESSAGE_ID: "m-2"}


def test_property_values_that_are_not_text_become_text_and_maps_are_dropped() -> None:
    message = proton.Message(
        body=b"{}", properties={"n": 5, "yes": True, "text": "t", "map": {"k": "v"}}
    )

    headers = decode(delivered(message)).envelope.headers

    assert headers["n"] == "5"
    assert headers["text"] == "t"
    assert "map" not in headers


def test_a_string_body_reads_as_its_utf8_bytes() -> None:
    received = decode(delivered(proton.Message(body="héllo ✓", id="m-3")))

    assert received.envelope.body == "héllo ✓".encode()
    assert Header.CONTENT_TYPE not in received.envelope.headers


def test_a_body_that_is_neither_bytes_nor_text_is_kept_encoded_and_marked_unreadable() -> None:
    message = proton.Message(body={"order_id": "o-1"}, id="m-4", content_type="application/json")

    received = decode(delivered(message))

    content_type = received.envelope.headers[Header.CONTENT_TYPE]
    assert content_type.startswith(UNREADABLE)
    assert content_type.endswith("type=map")
    assert amqp_decoded(received.envelope.body) == {"order_id": "o-1"}


def test_a_body_kept_encoded_is_bytes_as_an_envelope_body_must_be() -> None:
    received = decode(delivered(proton.Message(body={"order_id": "o-1"})))

    assert type(received.envelope.body) is bytes


def test_bytes_that_are_not_an_amqp_message_are_marked_unreadable() -> None:
    received = _read(b"not an AMQP message")

    assert received.envelope.headers[Header.CONTENT_TYPE].startswith(UNREADABLE)


def test_bytes_that_are_not_an_amqp_message_are_kept_whole() -> None:
    received = _read(b"not an AMQP message")

    assert received.envelope.body == b"not an AMQP message"


DATA_SECTION = b"\x00\x53\x75\xa0\x02{}"
"""A data section holding b"{}"."""


def header_section(*fields: bytes) -> bytes:
    """A header section (a list8) of encoded fields: durable, priority, ttl, first-acquirer,
    delivery-count."""
    return b"\x00\x53\x70\xc0" + bytes((len(b"".join(fields)) + 1, len(fields))) + b"".join(fields)


TRUE, FALSE, NULL, ZERO, TWO = b"\x41", b"\x42", b"\x40", b"\x43", b"\x52\x02"


@pytest.mark.parametrize(
    ("header", "redelivered"),
    [
        (header_section(TRUE, NULL, NULL, TRUE, ZERO), False),
        (header_section(TRUE, NULL, NULL, TRUE, TWO), True),
        (header_section(TRUE, NULL, NULL, FALSE, ZERO), True),  # RabbitMQ's redelivery
        (header_section(TRUE), False),  # first-acquirer not given: as our encode writes it
        (b"", False),
    ],
    ids=["first", "counted", "not-first-acquirer", "durable-only", "no-header"],
)
def test_redelivered_is_read_from_first_acquirer_and_the_delivery_count(
    header: bytes, redelivered: bool
) -> None:
    assert decode(header + DATA_SECTION).redelivered is redelivered


def test_a_message_as_encoded_reads_as_a_first_delivery() -> None:
    assert decode(encode(sent())).redelivered is False


def test_an_array_claiming_more_elements_than_bytes_is_refused_at_once() -> None:
    nulls = b"\x00\x53\x74\xf0" + struct.pack(">II", 5, 0xFFFFFFFF) + b"\x40"

    with pytest.raises(ValueError, match="4294967295 elements"):
        decode(nulls)


def test_a_large_body_of_another_type_is_kept_encoded_without_being_read() -> None:
    count = 20_000_000
    array = b"\x00\x53\x77\xf0" + struct.pack(">II", 5 + count, count) + b"\x56" + b"\x01" * count

    received = decode(array)

    assert received.envelope.body == array
    assert received.envelope.headers[Header.CONTENT_TYPE] == f"{UNREADABLE}; type=array"


def test_a_body_nested_past_the_stack_is_kept_whole_and_marked_unreadable() -> None:
    deep = b"\x00\x53\x77" + b"\xc0\x02\x01" * 100_000 + b"\x40"

    received = _read(deep)

    assert received.envelope.body == deep
    assert received.envelope.headers[Header.CONTENT_TYPE].startswith(UNREADABLE)


def test_a_character_past_unicode_is_kept_whole_and_marked_unreadable() -> None:
    past_unicode = b"\x00\x53\x77\x73\xff\xff\xff\xff"

    received = _read(past_unicode)

    assert received.envelope.body == past_unicode
    assert received.envelope.headers[Header.CONTENT_TYPE].startswith(UNREADABLE)
