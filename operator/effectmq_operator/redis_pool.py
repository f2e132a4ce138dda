"""The operator's Redis connections: one client per distinct Redis (URL and TLS
settings), shared by every Queue and Schedule that lives there, on a pool of at
most CONNECTIONS_PER_REDIS connections however many Queues it holds.

URLs from Secrets and CA bundles come from a cache: the operator reads by name only
the Secrets a Queue refers to (RBAC: `secrets get`, no list or watch of anyone's
Secrets), and reads each again when its copy is older than `secret_refresh` seconds
(SECRET_REFRESH, $EFFECTMQ_SECRET_REFRESH_SECONDS), so a rotated password is used
within that time and a poll reads a Secret at most once per interval, however many
Queues share it.

A Redis that did not answer is tried again by one poll at a time: while that poll
is in flight, the other Queues there report the same problem at once instead of
each holding a poll slot until its timeout.

Several URLs may reach one Redis (a short and a fully qualified Service name, an
IP, with or without `/0`, a Secret rotated in one namespace first, other TLS
options): each is its own RedisTarget (its own client), and `identity` tells which
of them share one scheduler store.

Credentials stay inside: every message that leaves this module is scrubbed of
the URL's secrets. So does the network's layout: a Queue's author chooses the URL and
reads the status, and the operator connects from its own place in the network, so
whatever does not answer as Redis (refused, reset, silent, an HTTP server, no such
host, a failed TLS handshake) gets one message there; the cause goes to this
module's log at debug level, for the platform team.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from kubernetes.client.rest import ApiException
import redis.asyncio as aioredis

import effectmq
from effectmq.transport.connection import URL_KINDS, RedisErrors, TlsOptions, connect, redis_answered
from effectmq.transport.redaction import SCHEMES, redact_url, scrub, url_secrets
from effectmq.scheduler import Scheduler

from .runtime.kube import Kube, api_error
from .spec import RedisSpec, SecretKeyRef
from .status import Problem

log = logging.getLogger("effectmq.operator.connections")
T = TypeVar("T")
SCHEDULER_NAMESPACE = "k8s"  # schedules live under {emq-sched:k8s} in each Queue's Redis
STORE_ID = "id"  # {emq-sched:k8s}:id: the identity of that store (no scheduler script touches it)
CONNECTIONS_PER_REDIS = 8  # also the polls at once per Redis: each uses one connection at a time
IDLE_CLIENT = 600.0  # seconds unused after which a Redis client is closed (a slower poll just reconnects)
SLOT_WAIT = 1.0  # seconds without any poll finishing on a Redis after which one waiting for a turn gives up
SECRET_REFRESH = 30.0  # seconds a Secret's cached copy is used before it is read again
URL_PREFIXES = tuple(f"{scheme}://" for scheme in sorted(SCHEMES))  # what effectmq.transport.connection.connect takes
NO_REDIS_ANSWER = ("Redis{where} did not answer as a Redis server: check spec.redis (host, port, TLS, "
                   "Sentinel service) and that the operator can reach it; the operator's log has the cause "
                   "(debug level)")


class ConfigProblem(Exception):
    """Input the operator cannot act on until someone changes it (a Stalled condition)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class StillUnreachable(Exception):
    """A poll not tried: its Redis did not answer the last one, and another poll is trying it again."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


@dataclass
class _Reach:
    """The polls on one Redis: a turn each, and whether the last one got through."""

    slots: asyncio.Semaphore
    in_flight: int = 0  # polls waiting for a turn or talking to it
    finished: int = 0  # polls that had their turn, answered or not
    problem: Problem | None = None  # why the last poll could not reach it


@dataclass(frozen=True)
class RedisTarget:
    """One Redis as the operator connects to it (one URL and TLS settings: two targets
    may reach the same Redis; `Connections.identity` tells)."""

    url: str = field(repr=False)
    tls: TlsOptions = TlsOptions()

    def __repr__(self) -> str:
        return f"RedisTarget({redact_url(self.url)})"

    @property
    def secrets(self) -> tuple[str, ...]:
        return url_secrets(self.url)


class Connections:
    def __init__(self, kube: Kube, *, max_connections: int = CONNECTIONS_PER_REDIS, socket_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, secret_refresh: float = SECRET_REFRESH):
        self.kube = kube
        self.clock = clock
        self.max_connections = max_connections
        self.socket_timeout = socket_timeout
        self.secret_refresh = secret_refresh
        self._clients: dict[RedisTarget, aioredis.Redis] = {}
        self._queues: dict[tuple[RedisTarget, str], effectmq.TaskQueue] = {}
        self._schedulers: dict[RedisTarget, Scheduler] = {}
        # (namespace, name) -> {"data": the Secret's data as last read (None: no such Secret), "read": when}
        self._secrets: dict[tuple[str, str], dict] = {}
        self._reads: dict[tuple[str, str], asyncio.Future] = {}  # Secrets being read now
        self._reach: dict[RedisTarget, _Reach] = {}
        self._used: dict[RedisTarget, float] = {}  # when each Redis was last used
        self._identities: dict[RedisTarget, str] = {}  # the scheduler store each target reached, as last read
        self._idle_checked = clock()

    # -- Secrets (read by name, again after secret_refresh) ---------------------------

    async def _read_secret(self, key: tuple[str, str]) -> None:
        """Read a Secret by name (one read per Secret, however many ask; a poll that gives
        up waiting does not cancel it for the others). A failed read again keeps the copy
        it has (the API server may be busy; a deleted Secret is a 404, not a failure)."""
        pending = self._reads.get(key)
        if pending is None:
            pending = self._reads[key] = asyncio.ensure_future(self._fetch_secret(key))
            pending.add_done_callback(lambda _: self._reads.pop(key, None))
        try:
            await asyncio.shield(pending)
        except ApiException as exc:
            if key in self._secrets:
                log.warning("Secret %s/%s not read again, its last copy is used: %s", *key, api_error(exc))
                return
            raise ConfigProblem("SecretUnreadable", f"Secret {key[0]}/{key[1]}: {api_error(exc)}") from None

    async def _fetch_secret(self, key: tuple[str, str]) -> None:
        entry = await self.kube.secret(*key)
        self._secrets[key] = {"data": None if entry is None else entry.get("data") or {}, "read": self.clock()}

    async def _secret(self, namespace: str, ref: SecretKeyRef) -> bytes:
        key = (namespace, ref.name)
        known = self._secrets.get(key)
        if known is None or self.clock() - known["read"] >= self.secret_refresh:
            await self._read_secret(key)
        raw = (self._secrets[key]["data"] or {}).get(ref.key)
        if raw is None:
            raise ConfigProblem("SecretNotFound", f"Secret {namespace}/{ref.name} with key {ref.key!r} not found")
        try:
            return base64.b64decode(raw)
        except (binascii.Error, ValueError):
            raise ConfigProblem("SecretUnreadable", f"Secret {namespace}/{ref.name} key {ref.key!r} is not "
                                "base64 data") from None

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
        if not url.startswith(URL_PREFIXES):
            # Never echo the value: a mistyped Secret may hold a bare password.
            raise ConfigProblem("InvalidRedisURL", f"{where} does not hold {URL_KINDS}")
        ca = None
        if redis.tls.ca_from:
            ca = (await self._secret(namespace, redis.tls.ca_from)).decode(errors="replace")
        return RedisTarget(url, TlsOptions(enabled=redis.tls.enabled, insecure=redis.tls.insecure_skip_verify,
                                           ca_data=ca))

    # -- clients -----------------------------------------------------------------

    def client(self, target: RedisTarget) -> aioredis.Redis:
        self._touch(target)
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
        self._touch(target)
        q = self._queues.get((target, name))
        if q is None:
            q = effectmq.TaskQueue(name, redis=self.client(target), url=target.url)  # url: for messages, masked
            self._queues[(target, name)] = q
        return q

    def scheduler(self, target: RedisTarget) -> Scheduler:
        self._touch(target)
        scheduler = self._schedulers.get(target)
        if scheduler is None:
            scheduler = Scheduler(self.client(target), namespace=SCHEDULER_NAMESPACE, url=target.url)
            self._schedulers[target] = scheduler
        return scheduler

    async def identity(self, target: RedisTarget) -> str:
        """The identity of the scheduler store `target` reaches, read now: the same for
        every URL of one Redis database, another for another database or server.

        A random id written into the scheduler namespace on first use (SET NX), so
        every client of that Redis reads the one that won. It lives with the schedules:
        it survives a restart with persistence and a failover (replicated), where the
        server's run_id changes (and run_id is one for every database of a server); a
        Redis that lost its schedules (flushed, restarted empty) gets a new one."""
        store = self.scheduler(target).store
        key = store.base + STORE_ID
        with RedisErrors(store.client, f"at {redact_url(target.url)} (the scheduler store's identity)"):
            while True:  # once, unless the key goes between a SET NX that lost and the GET after it
                found = await store.client.get(key)
                if found is None:
                    new = uuid.uuid4().hex
                    if await store.client.set(key, new, nx=True):
                        found = new
                if found is not None:
                    break
        identity = found if isinstance(found, str) else found.decode()  # decode_responses: always str
        self._identities[target] = identity
        return identity

    def known_identity(self, target: RedisTarget) -> str | None:
        """The identity `target` last read (None: never read, or its client was closed)."""
        return self._identities.get(target)

    def _touch(self, target: RedisTarget) -> None:
        """Note a use of `target`; close the clients of Redis targets nobody used for IDLE_CLIENT
        (a rotated Secret leaves its old URL behind, a Queue moves or goes away)."""
        now = self.clock()
        self._used[target] = now
        if now - self._idle_checked < IDLE_CLIENT / 10:
            return
        self._idle_checked = now
        for idle in [t for t, used in self._used.items() if now - used > IDLE_CLIENT]:
            del self._used[idle]
            self._reach.pop(idle, None)
            self._schedulers.pop(idle, None)
            self._identities.pop(idle, None)
            for key in [k for k in self._queues if k[0] == idle]:
                del self._queues[key]
            client = self._clients.pop(idle, None)
            if client is not None:
                asyncio.ensure_future(self._close_client(idle, client))

    @staticmethod
    async def _close_client(target: RedisTarget, client: aioredis.Redis) -> None:
        try:
            await client.aclose()
        except Exception as exc:  # closing a dead connection is not a problem
            log.debug("closing %r: %s", target, exc)

    def problem(self, exc: BaseException, target: RedisTarget | None = None) -> Problem:
        """What a failure means for a resource's conditions, with no credential in it."""
        secrets = target.secrets if target else ()
        if isinstance(exc, StillUnreachable):
            return exc.problem
        if isinstance(exc, ConfigProblem):
            return Problem(exc.reason, scrub(exc.message, *secrets), permanent=True)
        if isinstance(exc, effectmq.InvalidOption):
            return Problem("InvalidSpec", scrub(str(exc), *secrets), permanent=True)
        if not redis_answered(exc):  # refused, reset, timed out, not Redis, no such host: all alike
            log.debug("%r did not answer as a Redis server: %s: %s", target, type(exc).__name__,
                      scrub(str(exc), *secrets) or "no reply in time")
            where = f" at {redact_url(target.url)}" if target else ""
            return Problem("RedisUnreachable", NO_REDIS_ANSWER.format(where=where))
        if isinstance(exc, effectmq.RedisUnavailable):  # a reply: a wrong password, LOADING, ...
            return Problem("RedisUnreachable", scrub(str(exc), *secrets))
        return Problem("RedisError", scrub(f"Redis error: {type(exc).__name__}: {exc}", *secrets))

    # -- polls, a few at a time per Redis ---------------------------------------------

    async def poll(self, target: RedisTarget, work: Callable[[], Awaitable[T]], deadline: float) -> T:
        """Run one poll's Redis calls on `target`, at most max_connections at once there.

        A poll that gets no answer within `deadline`, or waits SLOT_WAIT for a turn
        while no poll there finishes, marks the Redis unreachable; until one of the
        polls in flight gets through again, others fail at once (StillUnreachable)
        instead of each spending a reconcile slot waiting for their timeout."""
        reach = self._reach.get(target)
        if reach is None:
            reach = self._reach[target] = _Reach(asyncio.Semaphore(self.max_connections))
        if reach.problem is not None and reach.in_flight:
            raise StillUnreachable(reach.problem)
        reach.in_flight += 1
        try:
            while True:
                finished = reach.finished
                try:
                    async with asyncio.timeout(SLOT_WAIT):
                        await reach.slots.acquire()
                    break
                except TimeoutError:
                    if reach.finished == finished:  # busy is fine, stuck is not
                        raise
            try:
                async with asyncio.timeout(deadline):
                    result = await work()
            finally:
                reach.slots.release()
                reach.finished += 1
        except Exception as exc:
            problem = self.problem(exc, target)
            reach.problem = problem if problem.reason == "RedisUnreachable" else None
            raise
        finally:
            reach.in_flight -= 1
        reach.problem = None
        return result

    async def close(self) -> None:
        """Close every client (the operator is stopping)."""
        clients, self._clients = self._clients, {}
        self._queues.clear()
        self._schedulers.clear()
        self._identities.clear()
        for target, client in clients.items():
            await self._close_client(target, client)
