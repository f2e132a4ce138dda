"""Redis clients for the engine and the scheduler: one place decides their settings,
and one place turns redis-py's transport errors into `RedisUnavailable`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.asyncio.sentinel as aioredis_sentinel
import redis.exceptions as redis_errors
import redis.sentinel as redis_sentinel
from redis.asyncio.cluster import RedisCluster

from ..errors import InvalidOption, RedisRefused, RedisUnavailable
from .cluster import cluster_client, is_cluster_url
from .redaction import INVALID_URL, SCHEMES, SECRET_OPTIONS, redact_url, scrub, url_secrets
from .sentinel import is_sentinel_url, sentinel_client

DEFAULT_URL = "redis://localhost:6379/0"
URL_VARIABLE = "EFFECTMQ_REDIS_URL"
URL_FILE_VARIABLE = "EFFECTMQ_REDIS_URL_FILE"
URL_FILE_LIMIT = 64 * 1024  # bytes: a file this long holds no URL (and is not read further)
# Every URL form connect() takes (redaction.SCHEMES), in the order messages name them:
# URL_KINDS is the one text every bad-URL message of the CLI and the operator shows.
URL_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
assert set(URL_SCHEMES) == SCHEMES, "a URL form is missing from the messages"
URL_KINDS = "a " + ", ".join(f"{s}://" for s in URL_SCHEMES[:-1]) + f" or {URL_SCHEMES[-1]}:// URL"
GIVEN_CLIENT = "the given client"  # how messages name a client passed in without a URL
TRANSPORT_ERRORS = (redis_errors.ConnectionError, redis_errors.TimeoutError)
# Error replies that mean "not now": the command did not run and the same call can be
# sent again later. (A script's first write is refused before it changes anything.)
# On a cluster, the script runner (effectmq.protocol.routing) sends a call refused with TRYAGAIN
# (its slot is migrating) again itself, and follows MOVED and ASK: they reach a caller
# only when the call's patience ran out during a long migration, or from a plain client
# to a cluster node (the message says so). A worker's loops back off from them, its
# heartbeat tries again inside the lease's safety window, as from a lost connection.
RETRYABLE_REPLIES = frozenset({
    "OOM", "BUSY", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MISCONF", "NOREPLICAS",
    "MOVED", "ASK",
})
# How messages name redis-py's own cluster errors that are not replies: a slot no master
# serves (during a failover) or a slot map no seed node could give.
CLUSTER = "CLUSTER"


# The error codes that redis-py's parser cuts off the reply's text when it picks an
# exception class for them (redis/_parsers/base.py, EXCEPTION_CLASSES). Newer redis-py
# (8.x) keeps the code on the exception (`status_code`); 5.x does not, so the class
# names it. getattr: a name missing from some redis-py version is skipped.
_CODE_OF_CLASS = {cls: code for name, code in (
    ("OutOfMemoryError", "OOM"), ("ReadOnlyError", "READONLY"), ("MasterDownError", "MASTERDOWN"),
    ("TryAgainError", "TRYAGAIN"), ("ClusterDownError", "CLUSTERDOWN"), ("NoScriptError", "NOSCRIPT"),
    ("NoPermissionError", "NOPERM"), ("ExecAbortError", "EXECABORT"), ("MovedError", "MOVED"),
    ("AskError", "ASK"), ("ClusterCrossSlotError", "CROSSSLOT"),
) if (cls := getattr(redis_errors, name, None)) is not None}


# redis-py prefixes the error of a pipelined command with the command
# ("Command # 1 (ZRANGE ...) of pipeline caused error: ('BUSY ...',)"; 5.x without the
# tuple): the reply's own text follows.
_PIPELINE_ERROR = re.compile(r"Command # \d+ \(.*\) of pipeline caused error: \(?['\"]?(.*)", re.S)
# Redis 6.2 wraps the error of a command a script ran ("Error running script (call to
# f_<sha>): @user_script:158: @user_script: 158: -OOM command not allowed ..."); 7 passes
# the command's own reply on. Its code decides, as it would on 7.
_SCRIPT_ERROR = re.compile(r"(?:ERR )?Error running script \(call to [^)]*\): @\S+ @\S+ \d+: -(\S+)")


def _reply_text(exc: BaseException) -> str:
    text = str(exc)
    annotated = _PIPELINE_ERROR.match(text)
    return annotated.group(1) if annotated else text


def _stripped_code(exc: BaseException) -> str | None:
    """The code of a reply whose text redis-py stripped of it (redis-py 5.x): by its class."""
    for cls in type(exc).__mro__:  # the most derived first: MovedError is an AskError
        if cls in _CODE_OF_CLASS:
            return _CODE_OF_CLASS[cls]
    return None


# redis-py's connection errors that carry a Redis server's reply all the same.
_REPLIES_RAISED_AS_CONNECTION_ERRORS = tuple(cls for name in (
    "AuthenticationError", "AuthorizationError", "BusyLoadingError", "MaxClientsReachedError",
) if (cls := getattr(redis_errors, name, None)) is not None)


def redis_answered(exc: BaseException) -> bool:
    """Whether a Redis server's own reply is behind `exc` (an error reply, a refused
    password, a dataset still loading), as against nothing that speaks Redis: a connection
    refused, reset or timed out, an unknown host or socket, a failed TLS handshake, bytes
    that are not Redis' protocol. Whoever may write a URL for someone else's process to
    connect to (a Queue's author, the operator) must not learn which of the second kind it
    was: that maps the network from the process' place in it."""
    if isinstance(exc, (RedisUnavailable, RedisRefused)):
        return exc.answered
    if isinstance(exc, redis_errors.RedisClusterException):  # no seed answered, or one did and refused
        if isinstance(exc, redis_errors.SlotNotCoveredError):
            return True  # the slot map came from a node
        return exc.__cause__ is not None and redis_answered(exc.__cause__)
    if isinstance(exc, _REPLIES_RAISED_AS_CONNECTION_ERRORS):
        return True
    return not isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError,
                                redis_errors.InvalidResponse, OSError))


# redis-py's Sentinel discovery, when no Sentinel names a primary, raises MasterNotFoundError
# with each failed Sentinel's client repr (a thousand characters each) and its error:
# "No master found for 'svc' : <its client's repr> - <its error>, <the next one> - ...".
# Only the address and the error are shown (sentinel_failures).
_MASTER_NOT_FOUND = tuple(cls for cls in (getattr(redis_sentinel, "MasterNotFoundError", None),
                                          getattr(aioredis_sentinel, "MasterNotFoundError", None)) if cls)
_SENTINEL_ADDRESS = re.compile(r"host=([^,>]+),port=(\d+)")
_NEXT_SENTINEL = re.compile(r", ?(?=<redis\.|Redis<)")
_ERROR_CATEGORY = re.compile(r"^[a-z]+:(?=[A-Z]\w*Error)")  # redis-py 8's "server:", "auth:", "network:"
SENTINEL_ERROR_LIMIT = 120  # characters of each Sentinel's error shown


def sentinel_failures(exc: BaseException) -> tuple[str, list[tuple[str, str]]] | None:
    """For a MasterNotFoundError: the service and each failed Sentinel's (host:port, error)."""
    if not isinstance(exc, _MASTER_NOT_FOUND):
        return None
    head, _, details = str(exc).partition(" : ")
    service = head.removeprefix("No master found for ")
    failures = []
    addresses = list(_SENTINEL_ADDRESS.finditer(details))
    for i, address in enumerate(addresses):
        end = addresses[i + 1].start() if i + 1 < len(addresses) else len(details)
        chunk = details[address.end():end]
        _, dash, why = chunk.partition("> - ")
        if not dash:
            continue
        why = _NEXT_SENTINEL.split(why, maxsplit=1)[0].strip().rstrip(",")
        why = _ERROR_CATEGORY.sub("", why)
        if len(why) > SENTINEL_ERROR_LIMIT:
            why = why[:SENTINEL_ERROR_LIMIT - 3] + "..."
        failures.append((f"{address.group(1)}:{address.group(2)}", why))
    return service, failures


def _sentinel_text(service: str, failures: list[tuple[str, str]]) -> str:
    if not failures:
        return (f"no Sentinel names a primary for {service} (those that answered do not know the service, or "
                "its primary is down)")
    return f"no Sentinel names a primary for {service} (" + "; ".join(f"{a}: {w}" for a, w in failures) + ")"


@dataclass(frozen=True)
class ReplyClass:
    code: str  # the reply's error code, or CONNECTION / TIMEOUT / AUTH for transport errors
    retryable: bool


def classify_reply(exc: BaseException) -> ReplyClass:
    """How a worker loop treats what redis-py raised: back off and retry, or give up."""
    if isinstance(exc, redis_errors.RedisClusterException):  # not a RedisError: no reply behind it
        if isinstance(exc.__cause__, redis_errors.AuthenticationError):
            return ReplyClass("AUTH", False)  # no seed accepted the password: as from one Redis
        transient = (isinstance(exc, redis_errors.SlotNotCoveredError)
                     or isinstance(exc.__cause__, TRANSPORT_ERRORS))
        return ReplyClass(CLUSTER, transient)
    if isinstance(exc, redis_errors.ClusterError) and not isinstance(exc, redis_errors.ClusterDownError):
        return ReplyClass(CLUSTER, True)  # redirected too often (a slot moving): as TRYAGAIN
    if isinstance(exc, redis_errors.TimeoutError):
        return ReplyClass("TIMEOUT", True)
    if isinstance(exc, redis_errors.BusyLoadingError):
        return ReplyClass("LOADING", True)
    sentinels = sentinel_failures(exc)
    if sentinels and sentinels[1] and all("AuthenticationError" in why for _, why in sentinels[1]):
        return ReplyClass("AUTH", False)  # every Sentinel refused the password: as from one Redis
    if isinstance(exc, redis_errors.AuthenticationError):
        return ReplyClass("AUTH", False)  # a wrong password stays wrong until the process restarts
    if isinstance(exc, redis_errors.ConnectionError):
        return ReplyClass("CONNECTION", True)
    text = _reply_text(exc)
    wrapped = _SCRIPT_ERROR.match(text)
    code = (wrapped.group(1) if wrapped else None) or getattr(exc, "status_code", None) or _stripped_code(exc) \
        or (text.split(" ", 1)[0] if text else "")
    if not code.isupper():
        code = "ERR"
    return ReplyClass(code, code in RETRYABLE_REPLIES)


def client_settings(client: aioredis.Redis | RedisCluster) -> dict[str, Any]:
    """The connection options of a client (a cluster client's apply to every node)."""
    if isinstance(client, RedisCluster):
        return client.get_connection_kwargs()
    return client.connection_pool.connection_kwargs


@dataclass(frozen=True)
class TlsOptions:
    """TLS to Redis: `enabled` upgrades redis:// to rediss:// (redis+sentinel:// to
    rediss+sentinel://, redis+cluster:// to rediss+cluster://); `ca_file` or `ca_data`
    (PEM) name the CA that signs the server; `insecure` skips verification."""

    enabled: bool = False
    insecure: bool = False
    ca_file: str | None = None
    ca_data: str | None = None

    @classmethod
    def from_env(cls) -> "TlsOptions":
        """What the operator passes to worker pods (EFFECTMQ_REDIS_TLS, _CA_FILE, _TLS_INSECURE)."""
        return cls(enabled=os.environ.get("EFFECTMQ_REDIS_TLS", "").lower() == "true",
                   insecure=os.environ.get("EFFECTMQ_REDIS_TLS_INSECURE", "").lower() == "true",
                   ca_file=os.environ.get("EFFECTMQ_REDIS_CA_FILE") or None)

    def apply(self, url: str) -> tuple[str, dict[str, Any]]:
        """The URL (rediss:// when enabled) and the client's TLS keyword arguments."""
        options: dict[str, Any] = {}
        if self.enabled and url.startswith(("redis://", "redis+sentinel://", "redis+cluster://")):
            url = "rediss" + url[len("redis"):]
        if url.startswith(("rediss://", "rediss+sentinel://", "rediss+cluster://")):
            if self.ca_file:
                options["ssl_ca_certs"] = self.ca_file
            if self.ca_data:
                options["ssl_ca_data"] = self.ca_data
            if self.insecure:
                options["ssl_cert_reqs"] = "none"
                options["ssl_check_hostname"] = False
            else:  # redis-py before 6.0 checked the certificate but not the name on it
                options["ssl_check_hostname"] = True
        return url, options


def url_from_env() -> str | None:
    """The Redis URL the environment gives: EFFECTMQ_REDIS_URL, or the content of the
    file EFFECTMQ_REDIS_URL_FILE names (one trailing newline dropped); None if neither.

    The file is how the operator passes a URL with a password (a mounted Secret): unlike
    a variable it is not inherited by child processes nor shown by /proc/<pid>/environ
    or crash dumps. Both set is an error: which one was meant is not ours to guess.
    Messages name the variable and the path, never the content (it may be a password).
    """
    url = os.environ.get(URL_VARIABLE) or None
    path = os.environ.get(URL_FILE_VARIABLE) or None
    if path is None:
        return url
    if url is not None:
        raise InvalidOption(f"{URL_VARIABLE} and {URL_FILE_VARIABLE} are both set: set only one "
                            f"({URL_FILE_VARIABLE} names a file that holds the URL)")
    where = f"{URL_FILE_VARIABLE} ({path})"
    try:
        with open(path, "rb") as f:
            raw = f.read(URL_FILE_LIMIT + 1)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise InvalidOption(f"{where} cannot be read: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError:
        raise InvalidOption(f"{where} cannot be read: it is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")  # as `echo` and `kubectl create secret` leave it
    if not text:
        raise InvalidOption(f"{where} is empty: it must hold the Redis URL")
    if len(raw) > URL_FILE_LIMIT or any(c.isspace() for c in text) or redact_url(text) == INVALID_URL:
        raise InvalidOption(f"{where} does not hold {URL_KINDS} on one line (its content is not shown: it may "
                            "be a password); percent-encode / ? # @ : in a password")
    return text


def connect(client: aioredis.Redis | RedisCluster | None = None, url: str | None = None, *,
            max_connections: int | None = None, socket_timeout: float | None = 15.0,
            tls: TlsOptions | None = None) -> tuple[Any, bool, str]:
    """The given client (checked), or a new one for `url`, else the environment's URL
    (`url_from_env`: EFFECTMQ_REDIS_URL or EFFECTMQ_REDIS_URL_FILE), else the default.

    Returns (client, whether the caller owns it and must close it, the URL with its
    password masked: the only form of it fit for messages). With `max_connections`,
    callers beyond the bound wait (up to the socket timeout) for a free connection.
    A redis+sentinel:// URL (see effectmq.transport.sentinel) connects to the service's primary,
    a redis+cluster:// URL (see effectmq.transport.cluster) to a Redis Cluster; a given client
    may be a `redis.asyncio.RedisCluster` too.
    The socket timeout bounds every reply, so a partition cannot hang a call.
    """
    if client is not None:
        if not client_settings(client).get("decode_responses"):
            raise InvalidOption("pass a redis client created with decode_responses=True")
        return client, False, redact_url(url) if url else GIVEN_CLIENT
    url, tls_options = (tls or TlsOptions.from_env()).apply(url or url_from_env() or DEFAULT_URL)
    shown = redact_url(url)
    scheme, slashes, _ = url.partition("://")
    if shown == INVALID_URL or not slashes or scheme.lower() not in SCHEMES:
        # redis-py's own complaint could quote part of the password, and names 3 forms of 7
        raise InvalidOption(f"the Redis URL is not {URL_KINDS} that can be read safely (not shown: it may hold "
                            "a password); percent-encode / ? # @ : in a password")
    try:
        options = dict(decode_responses=True, socket_connect_timeout=5, socket_timeout=socket_timeout,
                       health_check_interval=30, **tls_options)
        if is_sentinel_url(url):  # the primary that the Sentinels name, followed across failovers
            client = sentinel_client(url, max_connections=max_connections, **options)
        elif is_cluster_url(url):  # every node's pool holds at most max_connections
            client = cluster_client(url, max_connections=max_connections, **options)
        elif max_connections is None:
            client = aioredis.Redis.from_url(url, **options)
        else:  # a bounded pool waits for a free connection instead of failing with "Too many connections"
            pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                           timeout=socket_timeout, **options)
            client = aioredis.Redis.from_pool(pool)  # owns the pool: closed with the client
    except ValueError as exc:  # e.g. a query option redis-py cannot read
        raise InvalidOption(f"invalid Redis URL {shown}: {scrub(str(exc), *url_secrets(url))}") from None
    return client, True, shown


# What a MOVED or ASK reply to a plain client means.
CLUSTER_NODE_HINT = " (this Redis is a node of a Redis Cluster: connect with a redis+cluster:// URL)"


class RedisErrors:
    """`with errors:` turns what redis-py raises into RedisUnavailable (retryable: transport
    errors and the replies of RETRYABLE_REPLIES) or RedisRefused (anything else, a wrong or
    missing password included), naming `where`.

    The one place where redis-py's text enters ours: it is scrubbed of the client's
    secrets, and the original is chained only when it held none (a traceback prints it).
    """

    __slots__ = ("where", "secrets", "hint")

    def __init__(self, client: aioredis.Redis | RedisCluster, where: str):
        self.where = where
        settings = client_settings(client)
        self.secrets = tuple(str(settings[name]) for name in SECRET_OPTIONS if settings.get(name))
        self.hint = "" if isinstance(client, RedisCluster) else CLUSTER_NODE_HINT

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, (redis_errors.RedisError, redis_errors.RedisClusterException)):
            return
        reply = classify_reply(exc)
        sentinels = sentinel_failures(exc)
        raw = str(exc) if sentinels is None else _sentinel_text(*sentinels)
        text = scrub(raw, *self.secrets) or reply.code
        cause = exc if text == str(exc) else None  # a traceback would print the original
        if not isinstance(exc, TRANSPORT_ERRORS) and not text.startswith(reply.code):
            text = f"{reply.code} {text}"
        if reply.code in ("MOVED", "ASK"):
            text += self.hint
        answered = redis_answered(exc)
        if reply.code == "AUTH":  # a wrong or missing password: Redis (or a Sentinel) answered; retrying never helps
            raise RedisRefused(f"Redis refused {self.where}: {text}", reply.code, answered=True) from cause
        if isinstance(exc, (*TRANSPORT_ERRORS, redis_errors.RedisClusterException)):  # no reply: not reached
            raise RedisUnavailable(f"Redis unavailable {self.where}: {text}", reply.code, reply.retryable,
                                   answered=answered) from cause
        if reply.retryable:
            raise RedisUnavailable(f"Redis refused for now {self.where}: {text}", reply.code,
                                   answered=answered) from cause
        raise RedisRefused(f"Redis refused {self.where}: {text}", reply.code, answered=answered) from cause


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
