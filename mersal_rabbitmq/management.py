"""The RabbitMQ management HTTP API, for what AMQP does not say: unacked counts, queue listings.

Read-only GETs with the standard library, in a thread. The API refreshes its counts every few
seconds (`collect_statistics_interval`, 5 s by default), so they lag the queue a little.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.parse import quote, unquote, urlencode, urlsplit
from urllib.request import HTTPHandler, HTTPSHandler, OpenerDirector, Request, build_opener

from mersal.loop import in_daemon_thread
from mersal.urls import split_urls

PORT = 15672
TLS_PORT = 15671
TIMEOUT = 5.0
"""Seconds each socket operation of a request may take."""
DEADLINE = 10.0
"""Seconds a whole look at the API may take (a server that trickles bytes never times out)."""
PAGE_SIZE = 500  # the most the API returns in one page
ENABLE = "enable it (`rabbitmq-plugins enable rabbitmq_management`) or pass --management URL"


@dataclass(frozen=True)
class Management:
    """Where a vhost's management API is, and who asks it."""

    base: str
    """The API's base URL, without credentials: `http://host:15672`."""
    vhost: str
    user: str
    password: str = field(repr=False)
    others: tuple[str, ...] = ()
    """The base URLs asked, in order, when `base` does not answer (the other nodes')."""

    @classmethod
    def of(
        cls, amqp_url: str, management: str | None = None, *, node: str | None = None
    ) -> Management:
        """The API of the broker at `amqp_url`, or at `management`.

        Of a `;` list of nodes: the API of `node` (the one connected to) if given, else of the
        first; the others' when it does not answer. `management` may carry a user and
        password; the AMQP URL's are used otherwise.
        """
        nodes = [url.strip() for url in split_urls(amqp_url) if url.strip()] or [amqp_url]
        if node is not None and node in nodes:
            nodes.remove(node)
            nodes.insert(0, node)
        amqp = urlsplit(nodes[0])
        vhost = unquote(amqp.path[1:]) if len(amqp.path) > 1 else "/"
        user = unquote(amqp.username or "guest")
        password = unquote(amqp.password or "guest")
        if management is None:
            bases = list(dict.fromkeys(_api_base(url) for url in nodes))
            return cls(bases[0], vhost, user, password, tuple(bases[1:]))
        given = urlsplit(management if "://" in management else f"http://{management}")
        if given.username:
            user, password = unquote(given.username), unquote(given.password or "")
        host = given.netloc.rpartition("@")[2]
        return cls(f"{given.scheme}://{host}{given.path.rstrip('/')}", vhost, user, password)

    async def look(self, names: Sequence[str], waits_of: Sequence[str]) -> View:
        """The unacked counts of `names`, and the wait queues of `waits_of`; never raises."""
        patterns = [re.escape(name) for name in names]
        patterns += [f"{re.escape(queue)}\\.wait\\.[0-9]+" for queue in waits_of]
        if not patterns:
            return View()
        query = {
            "page": "1",
            "page_size": str(PAGE_SIZE),
            "name": f"^({'|'.join(patterns)})$",
            "use_regex": "true",
            "columns": "name,messages_unacknowledged",
        }
        path = f"/api/queues/{quote(self.vhost, safe='')}"
        try:
            page = await self._ask(path, query)
        except ManagementUnavailable as error:
            return View(note=str(error))
        items = page.get("items") if isinstance(page, dict) else page  # paged, or not
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            return View(
                note=f"the RabbitMQ management API at {self.base} answered what is not a "
                "list of queues: is --management the API's base URL?"
            )
        return _view(items, set(names))

    async def bindings(self, queue: str) -> list[tuple[str, str]]:
        """(exchange, routing key) of each binding of `queue` but the default exchange's.

        ManagementUnavailable if the API could not be asked.
        """
        return sorted((str(row["source"]), _routing_key(row)) for row in await self._bound(queue))

    async def plain_bindings(self, queue: str) -> list[tuple[str, str]]:
        """Those of `bindings` that have no arguments (only such a binding is unbound by its key).

        ManagementUnavailable if the API could not be asked.
        """
        return sorted(
            (str(row["source"]), _routing_key(row))
            for row in await self._bound(queue)
            if not row.get("arguments")
        )

    async def _bound(self, queue: str) -> list[dict[str, Any]]:
        """The API's rows for the bindings of `queue` from a named exchange."""
        path = f"/api/queues/{quote(self.vhost, safe='')}/{quote(queue, safe='')}/bindings"
        rows = await self._ask(path)
        if not isinstance(rows, list):
            raise ManagementUnavailable(
                f"the RabbitMQ management API at {self.base} answered what is not a list of "
                f"bindings for queue {queue!r}"
            )
        return [
            row
            for row in rows
            if isinstance(row, dict) and isinstance(row.get("source"), str) and row["source"]
        ]

    async def queue(self, name: str) -> dict[str, Any] | None:
        """What the API says about queue `name` (type, arguments, effective policy); None if absent.

        ManagementUnavailable if the API could not be asked.
        """
        path = f"/api/queues/{quote(self.vhost, safe='')}/{quote(name, safe='')}"
        info = await self._ask(path, missing_ok=True)
        if info is not None and not isinstance(info, dict):
            raise ManagementUnavailable(
                f"the RabbitMQ management API at {self.base} answered what is not a queue for "
                f"{name!r}: is it the API's base URL?"
            )
        return info

    async def _ask(
        self, path: str, query: dict[str, str] | None = None, *, missing_ok: bool = False
    ) -> Any:
        """`get` in a thread of its own, within DEADLINE; ManagementUnavailable if not."""
        try:
            async with asyncio.timeout(DEADLINE):
                return await in_daemon_thread(self.get, path, query or {}, missing_ok)
        except TimeoutError:
            raise ManagementUnavailable(
                f"the RabbitMQ management API at {self.base} did not answer within "
                f"{DEADLINE:g}s: {ENABLE}"
            ) from None

    def get(self, path: str, query: dict[str, str], missing_ok: bool = False) -> Any:
        """GET `path` (blocking): the JSON answer, or ManagementUnavailable saying why not.

        With `missing_ok`, None for a 404 (what `path` names does not exist). A base that does
        not answer at all is passed over for the next of `others`.
        """
        try:
            return self._get(path, query, missing_ok)
        except _NoAnswer as error:
            if not self.others:
                raise ManagementUnavailable(str(error)) from None
        following = replace(self, base=self.others[0], others=self.others[1:])
        return following.get(path, query, missing_ok)

    def _get(self, path: str, query: dict[str, str], missing_ok: bool) -> Any:
        request = Request(f"{self.base}{path}?{urlencode(query)}".rstrip("?"))
        credentials = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {credentials}")
        sockets: list[socket.socket] = []
        cutoff = threading.Timer(DEADLINE, _shut, (sockets,))  # the caller gave up by then
        cutoff.daemon = True
        cutoff.start()
        try:
            with _opener(sockets).open(request, timeout=TIMEOUT) as answer:
                return json.load(answer)
        except HTTPError as error:
            if error.code == 404 and missing_ok:
                return None
            if error.code in (401, 403):
                raise ManagementUnavailable(
                    f"the RabbitMQ management API at {self.base} refused user {self.user!r} "
                    f"(HTTP {error.code}): pass --management http://user:password@host:{PORT}"
                ) from None
            raise ManagementUnavailable(
                f"the RabbitMQ management API at {self.base} answered HTTP {error.code}: {ENABLE}"
            ) from None
        except (URLError, OSError, ValueError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", error)
            raise _NoAnswer(
                f"the RabbitMQ management API did not answer at {self.base} ({reason}): {ENABLE}"
            ) from None
        finally:
            cutoff.cancel()
            _shut(sockets)


def _opener(sockets: list[socket.socket]) -> OpenerDirector:
    """An opener that adds each socket it connects to `sockets`, to be shut from outside.

    A server that trickles its answer never lets a read time out: the socket is shut at the
    DEADLINE, which ends the request and its thread.
    """

    class Plain(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            sockets.append(self.sock)

    class Secure(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            sockets.append(self.sock)

    class PlainHandler(HTTPHandler):
        def http_open(self, req: Request) -> http.client.HTTPResponse:
            return self.do_open(Plain, req)

    class SecureHandler(HTTPSHandler):
        def https_open(self, req: Request) -> http.client.HTTPResponse:
            return self.do_open(Secure, req)

    return build_opener(PlainHandler, SecureHandler)


def _shut(sockets: list[socket.socket]) -> None:
    """Shut the sockets down: a read blocked in another thread returns at once."""
    for sock in sockets:
        with contextlib.suppress(OSError):  # closed already
            sock.shutdown(socket.SHUT_RDWR)


class _NoAnswer(Exception):
    """The API did not answer at one base URL."""


def _api_base(amqp_url: str) -> str:
    """The management API's base URL on the host of an AMQP URL."""
    amqp = urlsplit(amqp_url)
    secure = amqp.scheme.lower() == "amqps"
    host = amqp.hostname or "localhost"
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"{'https' if secure else 'http'}://{host}:{TLS_PORT if secure else PORT}"


DEFAULT_DELIVERY_LIMIT = 20
"""The delivery limit RabbitMQ 4.0 and later give a quorum queue that sets none (3.x: none)."""


def _routing_key(row: Mapping[str, Any]) -> str:
    return str(row.get("routing_key", ""))


def delivery_limit(info: Mapping[str, Any], version: str) -> int | None:
    """The delivery limit in effect on a quorum queue the API described; None for no limit.

    The lowest of the queue's `x-delivery-limit` argument and its policies' `delivery-limit`
    (RabbitMQ applies the lowest); on RabbitMQ 4.0 and later a negative one means none, and
    a queue that sets none has DEFAULT_DELIVERY_LIMIT.
    """
    arguments = info.get("arguments")
    policy = info.get("effective_policy_definition")
    values = [
        value
        for value in (
            arguments.get("x-delivery-limit") if isinstance(arguments, Mapping) else None,
            policy.get("delivery-limit") if isinstance(policy, Mapping) else None,
            info.get("delivery_limit"),
        )
        if isinstance(value, int) and not isinstance(value, bool)
    ]
    limits = [value for value in values if value >= 0]
    if limits:
        return min(limits)
    if values or major_version(version) < 4:
        return None
    return DEFAULT_DELIVERY_LIMIT


def major_version(version: str) -> int:
    """The major number of a RabbitMQ version such as '3.10.8' (0 if it is not one)."""
    head = version.strip().partition(".")[0]
    return int(head) if head.isdigit() else 0


class ManagementUnavailable(Exception):
    """The management API could not be asked; the message says why and what to do."""


@dataclass(frozen=True)
class View:
    """What the management API said: unacked counts by queue, the wait queues it lists."""

    unacked: dict[str, int] = field(default_factory=dict)
    waits: list[str] = field(default_factory=list)
    note: str | None = None
    """Why the API could not be asked, and what to do about it."""


def _view(items: list[dict[str, Any]], names: set[str]) -> View:
    """The unacked counts the items carry (a queue not counted yet has none) and the waits."""
    named = [item for item in items if isinstance(item.get("name"), str)]
    unacked = {
        item["name"]: count
        for item in named
        if isinstance(count := item.get("messages_unacknowledged"), int)
        and not isinstance(count, bool)
        and count >= 0
    }
    return View(unacked, [item["name"] for item in named if item["name"] not in names])
