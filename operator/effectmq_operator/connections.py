"""The operator's Redis connections: one client per distinct Redis (URL and TLS
settings), shared by every Queue and Schedule that lives there.

URLs from Secrets and CA bundles are read through a short cache (a Secret read
per poll would cost an API call per Queue every few seconds); a Redis error
drops the cached value, so a rotated password is picked up on the next try.
Credentials stay inside: every message that leaves this module is scrubbed of
the URL's secrets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException
import redis.asyncio as aioredis

import effectmq
from effectmq.connection import TlsOptions, connect
from effectmq.redaction import redact_url, scrub, url_secrets
from effectmq.scheduler import Scheduler

from .kube import Kube, api_error
from .spec import RedisSpec, SecretKeyRef
from .status import Problem

log = logging.getLogger("effectmq.operator.connections")
SCHEDULER_NAMESPACE = "k8s"  # schedules live under {emq-sched:k8s} in each Queue's Redis
SECRET_TTL = 120.0  # seconds a Secret's value is reused before it is read again
URL_SCHEMES = ("redis://", "rediss://", "unix://")


class ConfigProblem(Exception):
    """Input the operator cannot act on until someone changes it (a Stalled condition)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class RedisTarget:
    """One Redis as the operator connects to it."""

    url: str = field(repr=False)
    tls: TlsOptions = TlsOptions()

    def __repr__(self) -> str:
        return f"RedisTarget({redact_url(self.url)})"

    @property
    def secrets(self) -> tuple[str, ...]:
        return url_secrets(self.url)


class Connections:
    def __init__(self, kube: Kube, *, max_connections: int = 64, socket_timeout: float = 5.0):
        self.kube = kube
        self.max_connections = max_connections
        self.socket_timeout = socket_timeout
        self._clients: dict[RedisTarget, aioredis.Redis] = {}
        self._queues: dict[tuple[RedisTarget, str], effectmq.TaskQueue] = {}
        self._schedulers: dict[RedisTarget, Scheduler] = {}
        self._secrets: dict[tuple[str, str, str], tuple[float, bytes | None]] = {}

    # -- where a Redis is ------------------------------------------------------------

    async def _secret(self, namespace: str, ref: SecretKeyRef) -> bytes:
        key = (namespace, ref.name, ref.key)
        cached = self._secrets.get(key)
        if cached is not None and time.monotonic() - cached[0] < SECRET_TTL:
            value = cached[1]
        else:
            try:
                value = await self.kube.secret_value(namespace, ref.name, ref.key)
            except ApiException as exc:
                raise ConfigProblem("SecretUnreadable", f"Secret {namespace}/{ref.name}: {api_error(exc)}") from None
            self._secrets[key] = (time.monotonic(), value)
        if value is None:
            raise ConfigProblem("SecretNotFound", f"Secret {namespace}/{ref.name} with key {ref.key!r} not found")
        return value

    def forget(self) -> None:
        """Drop cached Secret values (after a Redis error: the Secret may have been rotated)."""
        self._secrets.clear()

    async def target(self, namespace: str, redis: RedisSpec) -> RedisTarget:
        """The Redis of a Queue's spec; ConfigProblem when its Secret or URL is unusable."""
        if redis.url_from:
            raw = await self._secret(namespace, redis.url_from)
            where = f"Secret {namespace}/{redis.url_from.name} key {redis.url_from.key!r}"
            try:
                url = raw.decode().strip()
            except UnicodeDecodeError:
                raise ConfigProblem("InvalidRedisURL", f"{where} is not UTF-8 text") from None
        else:
            url, where = redis.url or "", "spec.redis.url"
        if not url.startswith(URL_SCHEMES):
            # Never echo the value: a mistyped Secret may hold a bare password.
            raise ConfigProblem("InvalidRedisURL", f"{where} does not hold a redis://, rediss:// or unix:// URL")
        ca = None
        if redis.tls.ca_from:
            ca = (await self._secret(namespace, redis.tls.ca_from)).decode(errors="replace")
        return RedisTarget(url, TlsOptions(enabled=redis.tls.enabled, insecure=redis.tls.insecure_skip_verify,
                                           ca_data=ca))

    # -- clients -----------------------------------------------------------------

    def client(self, target: RedisTarget) -> aioredis.Redis:
        client = self._clients.get(target)
        if client is None:
            try:
                client, _, _ = connect(url=target.url, tls=target.tls, max_connections=self.max_connections,
                                       socket_timeout=self.socket_timeout)
            except ValueError:
                raise ConfigProblem("InvalidRedisURL", f"cannot parse the Redis URL {redact_url(target.url)}") from None
            self._clients[target] = client
        return client

    def queue(self, target: RedisTarget, name: str) -> effectmq.TaskQueue:
        q = self._queues.get((target, name))
        if q is None:
            q = effectmq.TaskQueue(name, redis=self.client(target), url=target.url)  # url: for messages, masked
            self._queues[(target, name)] = q
        return q

    def scheduler(self, target: RedisTarget) -> Scheduler:
        scheduler = self._schedulers.get(target)
        if scheduler is None:
            scheduler = Scheduler(self.client(target), namespace=SCHEDULER_NAMESPACE, url=target.url)
            self._schedulers[target] = scheduler
        return scheduler

    def problem(self, exc: BaseException, target: RedisTarget | None = None) -> Problem:
        """What a failure means for a resource's conditions, with no credential in it."""
        secrets = target.secrets if target else ()
        if isinstance(exc, ConfigProblem):
            return Problem(exc.reason, scrub(exc.message, *secrets), permanent=True)
        if isinstance(exc, effectmq.InvalidOption):
            return Problem("InvalidSpec", scrub(str(exc), *secrets), permanent=True)
        self.forget()
        if isinstance(exc, effectmq.RedisUnavailable):
            return Problem("RedisUnreachable", scrub(str(exc), *secrets))
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            where = f" at {target!r}" if target else ""
            return Problem("RedisUnreachable", f"Redis{where} did not answer in time")
        return Problem("RedisError", scrub(f"Redis error: {type(exc).__name__}: {exc}", *secrets))

    async def close(self) -> None:
        """Close every client (the operator is stopping)."""
        clients, self._clients = self._clients, {}
        self._queues.clear()
        self._schedulers.clear()
        for target, client in clients.items():
            try:
                await client.aclose()
            except Exception as exc:  # closing a dead connection is not a problem
                log.debug("closing %r: %s", target, exc)
