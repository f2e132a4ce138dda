"""Redis clients for the engine and the scheduler: one place decides their settings."""

from __future__ import annotations

import os
from typing import Any

import redis.asyncio as aioredis

from .errors import InvalidOption

DEFAULT_URL = "redis://localhost:6379/0"


def tls_from_env(url: str) -> tuple[str, dict[str, Any]]:
    """TLS settings the operator passes to worker pods (EFFECTMQ_REDIS_TLS, _CA_FILE, _TLS_INSECURE)."""
    options: dict[str, Any] = {}
    if os.environ.get("EFFECTMQ_REDIS_TLS", "").lower() == "true" and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    if url.startswith("rediss://"):
        if os.environ.get("EFFECTMQ_REDIS_CA_FILE"):
            options["ssl_ca_certs"] = os.environ["EFFECTMQ_REDIS_CA_FILE"]
        if os.environ.get("EFFECTMQ_REDIS_TLS_INSECURE", "").lower() == "true":
            options["ssl_cert_reqs"] = "none"
    return url, options


def connect(client: aioredis.Redis | None = None, url: str | None = None, *, max_connections: int | None = None,
            socket_timeout: float | None = 15.0) -> tuple[aioredis.Redis, bool, str]:
    """The given client (checked), or a new one for `url`, EFFECTMQ_REDIS_URL or the default.

    Returns (client, whether the caller owns it and must close it, the URL).
    The socket timeout bounds every reply, so a partition cannot hang a call.
    """
    if client is not None:
        if not client.connection_pool.connection_kwargs.get("decode_responses"):
            raise InvalidOption("pass a redis client created with decode_responses=True")
        return client, False, url or "the given client"
    url, tls = tls_from_env(url or os.environ.get("EFFECTMQ_REDIS_URL") or DEFAULT_URL)
    client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5,
                                     socket_timeout=socket_timeout, health_check_interval=30,
                                     max_connections=max_connections, **tls)
    return client, True, url


class OwnsConnection:
    """Async context manager for objects that may own their Redis client."""

    redis: aioredis.Redis
    _owns_client: bool

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_client:
            await self.redis.aclose()
