"""Redis Sentinel: find the current primary of a monitored service, and follow failovers.

URL form (the convention of redis-py's `Sentinel` class and kombu's ``sentinel://``)::

    redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2],...]/<service_name>[/<db>][?options]
    rediss+sentinel://...   (TLS to the Sentinels and to the primary)

- the hosts are the Sentinels (port 26379 when left out), not the Redis servers;
- ``service_name`` is the name the Sentinels monitor (``sentinel monitor <name> ...``);
- ``user``/``password`` (percent-encoded) authenticate to the primary (and replicas);
- options: ``sentinel_password`` and ``sentinel_username`` (percent-encoded) for
  Sentinels that have their own ``requirepass``/ACL user; ``min_other_sentinels``
  (ignore a Sentinel that sees fewer peers); ``db``, ``password``, ``username`` as
  alternatives to the path and userinfo; and redis-py's connection options
  (``socket_timeout``, ``socket_connect_timeout``, ``health_check_interval``, ...),
  which apply to the primary and, for the socket ones, to the Sentinels too.

Example: ``redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster/0?sentinel_password=p%40ss``.

Every new connection asks the Sentinels for the primary's address, so after a
failover the next connection goes to the promoted replica: connections to a dead
primary fail (ConnectionError) and are dropped, idle ones to a changed address
are closed, and a reply of READONLY from a demoted primary is turned into a
ConnectionError by redis-py (`SentinelManagedConnection.read_response`), so the
engine treats it like any lost connection (a retry-safe script is sent again once).
Passwords are never shown: messages name the URL through `redact_url`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from .multihost import connection_option, has_scheme, split_hosts
from .redaction import SENTINEL_SCHEMES

__all__ = ["DEFAULT_SENTINEL_PORT", "SentinelTarget", "is_sentinel_url", "parse_sentinel_url", "sentinel_client"]

DEFAULT_SENTINEL_PORT = 26379
# Options of the connections to the primary that the Sentinel connections share.
_SHARED_WITH_SENTINELS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options")
_OWN_OPTIONS = {"sentinel_password", "sentinel_username", "min_other_sentinels", "password", "username", "db"}


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed Sentinel URL. `repr` never shows a password."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    min_other_sentinels: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # further redis-py connection options


def is_sentinel_url(url: object) -> bool:
    """Whether `url` is a redis+sentinel:// or rediss+sentinel:// URL."""
    return has_scheme(url, SENTINEL_SCHEMES)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a Sentinel URL; ValueError (never quoting a password) when malformed."""
    if not is_sentinel_url(url):
        raise ValueError("not a redis+sentinel:// or rediss+sentinel:// URL")
    parts, sentinels, found = split_hosts(url, "Sentinel", DEFAULT_SENTINEL_PORT,
                                          "Sentinels as host[:port],host[:port],... before the service name")
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()  # a trailing slash
    if not path or not path[0] or len(path) > 2:
        raise ValueError("a Sentinel URL names the monitored service and optionally a db: .../<service_name>[/<db>]")
    service_name = path[0]
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ValueError("the db of a Sentinel URL (after the service name) must be a number")
        db = int(path[1])
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
        if name in _OWN_OPTIONS:
            if name in ("password", "username") and found.get(name):
                continue  # userinfo wins, as in redis-py
            if name in ("db", "min_other_sentinels"):
                if not value.isdigit():
                    raise ValueError(f"invalid value for {name!r} in the Sentinel URL: expected a number")
                found[name] = int(value)
            else:
                found[name] = value or None
        else:
            options[name] = connection_option(name, value, "Sentinel")
    return SentinelTarget(tuple(sentinels), service_name, db=found.pop("db", db),
                          tls=parts.scheme == "rediss+sentinel", options=options, **found)


class SentinelRedis(aioredis.Redis):
    """The client for the primary; closing it also closes its connections to the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None and (close_connection_pool or (close_connection_pool is None
                                                                  and self.auto_close_connection_pool)):
                await _close_sentinels(manager)


async def _close_sentinels(manager: Sentinel) -> None:
    close = getattr(manager, "aclose", None)
    if close is not None:
        await close()
        return
    # redis-py 5.x has no Sentinel.aclose (newer ones do): close its Sentinel clients as it would
    # (each one, the first error raised after all are closed).
    replies = await asyncio.gather(*(sentinel.aclose() for sentinel in manager.sentinels), return_exceptions=True)
    error = next((r for r in replies if isinstance(r, BaseException)), None)
    if error is not None:
        raise error


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel pool with BlockingConnectionPool's bound: beyond `max_connections`,
    callers wait up to `timeout` for a free connection (then ConnectionError)."""


def sentinel_client(url: str, *, max_connections: int | None = None, **redis_options: Any) -> aioredis.Redis:
    """A client for the current primary of the service that `url` names.

    `redis_options` are redis-py connection options (socket timeouts, TLS files, ...);
    options in the URL's query take precedence, as with `redis.asyncio.Redis.from_url`.
    With `max_connections`, callers beyond the bound wait (up to `socket_timeout`)
    for a free connection instead of failing. Raises ValueError for a malformed URL.
    """
    target = parse_sentinel_url(url)
    options: dict[str, Any] = {"decode_responses": True, **redis_options, **target.options, "db": target.db}
    for name in ("username", "password"):
        if getattr(target, name):
            options[name] = getattr(target, name)
    sentinel_kwargs = {k: options[k] for k in _SHARED_WITH_SENTINELS if k in options}
    # Fail fast, like the pools from_url builds: redis-py's Redis() would retry each
    # Sentinel 3 times with backoff (seconds per call when one is down or refuses AUTH);
    # the engine has its own retries, and discovery moves on to the next Sentinel.
    sentinel_kwargs["retry"] = options.get("retry") or Retry(NoBackoff(), 0)
    if target.tls:
        options["ssl"] = True
        sentinel_kwargs.update({k: v for k, v in options.items() if k == "ssl" or k.startswith("ssl_")})
    else:
        for name in [k for k in options if k.startswith("ssl_")]:
            del options[name]  # TLS settings for a plain-text URL: nothing to apply them to
    if target.sentinel_username:
        sentinel_kwargs["username"] = target.sentinel_username
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    manager = Sentinel(list(target.sentinels), min_other_sentinels=target.min_other_sentinels,
                       sentinel_kwargs=sentinel_kwargs)
    if max_connections is not None:
        options.update(connection_pool_class=BlockingSentinelConnectionPool, max_connections=max_connections,
                       timeout=options.get("socket_timeout"))
    return manager.master_for(target.service_name, redis_class=SentinelRedis, **options)
