"""`mersal status` asks the management API: whatever it answers, a note, never a crash.

The API here is a local HTTP server answering what a misconfigured proxy or another service
on the port might: JSON of the wrong shape, or bytes trickling in forever.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from mersal_rabbitmq import management
from mersal_rabbitmq.management import Management
from tests.support import eventually


class Answers(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the server's `body`, or trickles a byte a second."""

    def do_GET(self) -> None:
        body: object = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if body == "trickle":
            for _ in range(60):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:  # the client shut the socket: what the trickle is for
                    return
                time.sleep(1)
            return
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def api() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def at(server: http.server.ThreadingHTTPServer) -> Management:
    port = server.server_address[1]
    return Management.of("amqp://guest:guest@127.0.0.1/", f"http://127.0.0.1:{port}")


@pytest.mark.parametrize(
    "body",
    [{"items": None}, ["a", "b"], {"items": "queues"}, 7, None],
)
async def test_an_answer_that_is_not_a_list_of_queues_is_a_note(
    api: http.server.ThreadingHTTPServer, body: object
) -> None:
    api.body = body  # type: ignore[attr-defined]
    view = await at(api).look(["orders"], [])
    assert view.unacked == {}
    assert view.note is not None and "not a list of queues" in view.note


async def test_items_without_names_or_with_odd_counts_are_left_out(
    api: http.server.ThreadingHTTPServer,
) -> None:
    api.body = {  # type: ignore[attr-defined]
        "items": [
            {"messages_unacknowledged": 3},
            {"name": "orders", "messages_unacknowledged": True},
            {"name": "billing", "messages_unacknowledged": -1},
            {"name": "stock", "messages_unacknowledged": 4},
            {"name": 5, "messages_unacknowledged": 1},
        ]
    }
    view = await at(api).look(["orders", "billing", "stock"], [])
    assert view.unacked == {"stock": 4}
    assert view.note is None


async def test_an_api_that_trickles_bytes_is_given_up_on_after_the_deadline(
    api: http.server.ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.body = "trickle"  # type: ignore[attr-defined]
    monkeypatch.setattr(management, "DEADLINE", 1.0)
    started = time.monotonic()
    async with asyncio.timeout(10):
        view = await at(api).look(["orders"], [])
    assert time.monotonic() - started < 5
    assert view.note is not None and "did not answer within 1s" in view.note


async def test_a_request_given_up_on_ends_its_thread(
    api: http.server.ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.body = "trickle"  # type: ignore[attr-defined]
    monkeypatch.setattr(management, "DEADLINE", 0.5)

    def asking() -> int:
        return sum(1 for thread in threading.enumerate() if thread.name == "mersal-command")

    before = asking()
    await at(api).look(["orders"], [])
    await eventually(lambda: asking() <= before, "the request's thread ended", timeout=5)


@pytest.mark.parametrize(
    ("info", "version", "limit"),
    [
        (
            {"arguments": {"x-queue-type": "quorum"}, "effective_policy_definition": {}},
            "3.10.8",
            None,
        ),
        ({"arguments": {}, "effective_policy_definition": {"delivery-limit": 3}}, "3.10.8", 3),
        ({"arguments": {"x-delivery-limit": 5}, "effective_policy_definition": None}, "3.13.1", 5),
        (
            {
                "arguments": {"x-delivery-limit": 5},
                "effective_policy_definition": {"delivery-limit": 2},
            },
            "3.12.0",
            2,
        ),
        ({"arguments": {}, "effective_policy_definition": {}}, "4.0.5", 20),
        ({"arguments": {}, "effective_policy_definition": {"delivery-limit": -1}}, "4.1.0", None),
        ({"arguments": {"x-delivery-limit": 0}}, "4.0.0", 0),
        ({"arguments": {"x-delivery-limit": True}}, "", None),
    ],
)
def test_the_delivery_limit_in_effect_is_the_lowest_set_or_rabbitmq_4s_default(
    info: dict[str, object], version: str, limit: int | None
) -> None:
    assert management.delivery_limit(info, version) == limit


async def test_a_node_whose_api_does_not_answer_is_passed_over_for_the_next(
    api: http.server.ThreadingHTTPServer,
) -> None:
    api.body = [{"source": "mersal.events", "routing_key": "T"}]  # type: ignore[attr-defined]
    answering = at(api).base
    silent = Management("http://127.0.0.1:1", "/", "guest", "guest", others=(answering,))
    assert await silent.bindings("orders") == [("mersal.events", "T")]


def test_the_api_asked_is_the_connected_nodes_then_the_others() -> None:
    nodes = "amqp://u:p@h1/vh;amqp://u:p@h2/vh;amqps://u:p@h3/vh"
    first = Management.of(nodes)
    assert (first.base, first.others) == (
        "http://h1:15672",
        ("http://h2:15672", "https://h3:15671"),
    )
    connected = Management.of(nodes, node="amqp://u:p@h2/vh")
    assert connected.base == "http://h2:15672"
    assert connected.others == ("http://h1:15672", "https://h3:15671")
    assert Management.of(nodes, "http://admin:pw@api:15672").others == ()
