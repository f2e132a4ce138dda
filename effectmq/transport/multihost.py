"""What the URL forms that name several hosts (redis+sentinel://, redis+cluster://) share:
the scheme check, the host list, the credentials of the userinfo, and redis-py's
connection options in the query. Errors are ValueErrors that never quote a password."""

from __future__ import annotations

from typing import Any, Iterable
from urllib.parse import SplitResult, unquote, urlsplit

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

NOT_IN_URL = frozenset({"max_connections", "timeout"})  # set by connect(): max_connections bounds the pool


def has_scheme(url: object, schemes: Iterable[str]) -> bool:
    if not isinstance(url, str):
        return False
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in schemes


def split_hosts(url: str, kind: str, default_port: int, hosts_hint: str) -> tuple[SplitResult, list[tuple[str, int]],
                                                                                  dict[str, Any]]:
    """The URL's parts, its hosts as (host, port) and {"username", "password"} of its userinfo."""
    parts = urlsplit(url)
    if parts.fragment:
        raise ValueError(f"a {kind} URL has no #fragment (percent-encode '#' in a password)")
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    hosts = []
    for address in hostinfo.split(","):
        piece = urlsplit(f"//{address}")
        port = piece.port  # ValueError when not a number
        if not piece.hostname:
            raise ValueError(f"a {kind} URL lists {hosts_hint}")
        hosts.append((piece.hostname, port or default_port))
    user, colon, password = userinfo.partition(":")
    credentials = {"username": unquote(user) if user else None,
                   "password": unquote(password) if colon and password else None}
    return parts, hosts, credentials


def connection_option(name: str, value: str, kind: str) -> Any:
    """A redis-py connection option from the query, parsed as redis-py parses it."""
    if name not in URL_QUERY_ARGUMENT_PARSERS or name in NOT_IN_URL:
        raise ValueError(f"unknown option {name!r} in the {kind} URL")
    try:
        return URL_QUERY_ARGUMENT_PARSERS[name](value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid value for {name!r} in the {kind} URL") from None
