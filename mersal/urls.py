"""Broker and database URLs: several in one address, and their passwords kept out of sight."""

from __future__ import annotations

import re

_NEXT_URL = re.compile(r";(?=\s*(?:[A-Za-z][A-Za-z0-9+.-]*://|;|$))")

# A query parameter carrying a password (asyncpg reads `password` and `sslpassword` there).
_QUERY_PASSWORD = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


def split_urls(address: str) -> list[str]:
    """The URLs of an address that lists several separated by `;` (a cluster's nodes).

    Only a `;` followed by another URL's scheme (or by nothing, or another `;`) separates, so a
    password may contain one.
    """
    return _NEXT_URL.split(address)


def mask(url: str) -> str:
    """The URL with any password (user info or query) replaced by `***`, fit for logs.

    Several URLs separated by `;` (a cluster's nodes) are masked each.
    """
    urls = split_urls(url)
    if len(urls) > 1:
        return ";".join(mask(part) for part in urls)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    credentials, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}{sep}{user}{':***' if colon else ''}@{host}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def without_password(url: str) -> str:
    """The URL without any password (in its user info, or a query parameter), for commands."""
    urls = split_urls(url)
    if len(urls) > 1:
        return ";".join(without_password(part) for part in urls)
    masked = mask(url)
    if masked == url and "***" not in url:  # a URL masked already still loses its "***"
        return url
    scheme, separator, rest = masked.partition("://")
    user_info, at, host = rest.rpartition("@")
    if at:
        rest = f"{user_info.removesuffix(':***')}@{host}"
    base, question, query = (scheme + separator + rest).partition("?")
    query, hash_mark, fragment = query.partition("#")
    kept = [
        pair
        for pair in query.split("&")
        if not (pair.endswith("=***") and "password" in pair.partition("=")[0].lower())
    ]
    query = "&".join(pair for pair in kept if pair)
    return f"{base}{question if query else ''}{query}{hash_mark}{fragment}"
