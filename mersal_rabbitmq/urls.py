"""The node URLs of a transport address, refused when they cannot be the nodes of one cluster.

Several nodes are full URLs separated by `;` (as kombu takes them). The nodes of one cluster
serve the same vhosts over the same protocol, so every URL names the same vhost and the same
scheme (amqp or amqps); a `;` in a host or a path is a node written without its scheme. Query
options that Mersal reads itself (`queue_type`, `reconnect_interval`) are taken out of every
URL, and every node must carry the same options.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from mersal.errors import ConfigurationError
from mersal.urls import mask, split_urls

SCHEMES = ("amqp", "amqps")
MAX_OPTION_SECONDS = 3600.0
"""The longest number of seconds a URL option may give (longer is a mistake: an app that never
tries again)."""


def node_urls(address: str) -> list[str]:
    """The URLs of the nodes an address lists, in order; a ConfigurationError if they differ."""
    nodes = [node.strip() for node in split_urls(address) if node.strip()]
    for index in range(len(nodes)):
        _check_full(address, nodes, index)
    _check_same(address, "schemes", [_scheme(node) for node in nodes], _SCHEME_ADVICE)
    _check_same(address, "vhosts", [_vhost(node) for node in nodes], _VHOST_ADVICE)
    return nodes


_SCHEME_ADVICE = (
    "connect to every node with TLS (amqps://, port 5671 by default) or to none (amqp://)"
)
_VHOST_ADVICE = (
    "the nodes of a cluster serve the same vhosts: give every URL the same /vhost (a URL without "
    "one means '/')"
)


def _check_full(address: str, nodes: list[str], index: int) -> None:
    node = nodes[index]
    scheme, separator, _ = node.partition("://")
    if not separator or scheme.lower() not in SCHEMES:
        raise ConfigurationError(
            f"{mask(node)!r} in transport {mask(address)!r} is not an amqp:// or amqps:// URL: "
            "each node is a full URL (amqp://user:password@host:port/vhost), separated by ';'"
        )
    try:
        parts = urlsplit(node)
    except ValueError as error:  # an unclosed IPv6 bracket
        raise ConfigurationError(
            f"{mask(node)!r} in transport {mask(address)!r} is not a URL ({error}): write it as "
            "amqp://user:password@host:port/vhost, an IPv6 host in brackets ([::1])"
        ) from None
    userinfo, at, host = parts.netloc.rpartition("@")
    tail = f"{host}{parts.path}{'?' if parts.query else ''}{parts.query}"
    if ";" not in tail:
        return
    pieces = [piece for piece in tail.split(";") if piece]
    rest = next((piece[_rest_at(piece) :] for piece in pieces if _rest_at(piece) >= 0), "")
    split = [
        f"{parts.scheme}://{userinfo}{at}{piece if _rest_at(piece) >= 0 else piece + rest}"
        for piece in pieces
    ]
    written = ";".join([*nodes[:index], *split, *nodes[index + 1 :]])
    kept = parts._replace(path=parts.path.replace(";", "%3B")).geturl()
    others = [_vhost(other) for other in nodes if other is not node]
    if ";" in parts.path and others and all(vhost == _vhost(kept) for vhost in others):
        named = ";".join([*nodes[:index], kept, *nodes[index + 1 :]])
        raise ConfigurationError(
            f"transport {mask(address)!r} has a ';' inside the vhost of one URL, which would "
            f"end that URL there: write it %3B, as the other nodes do: {mask(named)}"
        )
    raise ConfigurationError(
        f"transport {mask(address)!r} has a ';' inside one URL, after its host, so the text "
        f"after it would be part of the host, the vhost or an option: each node is a full URL: "
        f"{mask(written)} (a ';' in a vhost's name is written %3B)"
    )


def _rest_at(piece: str) -> int:
    """Where the vhost or the options start in `host[:port]/vhost?options`, or -1."""
    found = [index for index in (piece.find("/"), piece.find("?")) if index >= 0]
    return min(found, default=-1)


def _check_same(address: str, what: str, values: list[str], advice: str) -> None:
    if len(set(values)) > 1:
        named = " / ".join(dict.fromkeys(repr(value) for value in values))
        raise ConfigurationError(
            f"the URLs of transport {mask(address)!r} name different {what} ({named}): {advice}"
        )


def _scheme(node: str) -> str:
    return node.partition("://")[0].lower()


def _vhost(node: str) -> str:
    """The vhost a URL logs in to, as aio-pika reads it (no path, or `/`, is '/')."""
    return unquote(urlsplit(node).path[1:]) or "/"


def nodes_of(address: str) -> list[str]:
    """The node URLs of a transport address: one URL, or several separated by `;`."""
    nodes = node_urls(address)
    if not nodes:
        raise ConfigurationError(
            f"transport {mask(address)!r} names no broker: use amqp://user:password@host/vhost, "
            "or several such URLs separated by ';' for a cluster"
        )
    queries = {urlsplit(node).query: _options(node) for node in nodes}
    if len(set(queries.values())) > 1:
        raise ConfigurationError(
            f"the URLs of {mask(address)!r} carry different query options "
            f"({' / '.join(sorted(queries))}): give every node the same ones"
        )
    return nodes


def take_option(address: str, name: str) -> tuple[str, str | None]:
    """The address without query option `name` (in every node's URL), and its value if given.

    Every node must give the same value, or none.
    """
    node_urls(address)
    values: dict[object, str | None] = {}  # each value as read: as written the first time
    nodes = []
    for node in split_urls(address):
        parts = urlsplit(node)
        query = parse_qsl(parts.query, keep_blank_values=True)
        value = next((v for k, v in query if k == name), None)
        if node.strip():
            values.setdefault(None if value is None else _value(value), value)
        kept = urlencode([(key, v) for key, v in query if key != name])
        nodes.append(node if value is None else parts._replace(query=kept).geturl())
    if len(values) > 1:
        given = " / ".join("none" if value is None else repr(value) for value in values.values())
        raise ConfigurationError(
            f"the URLs of transport {mask(address)!r} give different {name} options ({given}): "
            f"give every node the same ?{name}=..., or leave it out of every URL"
        )
    return ";".join(nodes), next(iter(values.values()), None)


def seconds_option(value: str, name: str) -> float:
    """A URL option's number of seconds: more than 0, at most MAX_OPTION_SECONDS."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_OPTION_SECONDS:
        raise ConfigurationError(
            f"{name}={value!r} in the transport URL is not a number of seconds from 0 to "
            f"{MAX_OPTION_SECONDS:g}: write {name}=1 (or any such number)"
        )
    return seconds


def _options(node: str) -> tuple[tuple[str, str], ...]:
    """A URL's query options as they are read: in any order, numbers by their value."""
    query = parse_qsl(urlsplit(node).query, keep_blank_values=True)
    return tuple(sorted((key, str(_value(value))) for key, value in query))


def _value(value: str) -> object:
    """A number as its value (2 and 2.0 are one), other text as it is."""
    try:
        number = float(value)
    except ValueError:
        return value
    return number if number == number else value
