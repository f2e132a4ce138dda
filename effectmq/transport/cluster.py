"""Redis Cluster: the cluster URL form and the client it gives.

URL form (the seed list of the Sentinel URL form, effectmq.transport.sentinel)::

    redis+cluster://[[user]:password@]host1[:port1][,host2[:port2],...][/0][?options]
    rediss+cluster://...   (TLS to every node)

- the hosts are seed nodes (port 6379 when left out): any one that answers is enough,
  the client reads the slot map (CLUSTER SLOTS) from it and finds every other node;
- ``user``/``password`` (percent-encoded) authenticate to every node;
- the db, when given, must be 0 (a cluster has no other);
- options: ``password``, ``username`` and redis-py's connection options
  (``socket_timeout``, ``socket_connect_timeout``, ``health_check_interval``, ...).

Example: ``redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000``.

Every key of a queue shares one hash tag (``{emq:<queue>}``), so a queue lives in one
slot; `effectmq.protocol.routing` sends its script calls to that slot's master, follows MOVED and
ASK and waits out a slot migration (TRYAGAIN). An ASK may name a node the client's slot
map does not list (a master added for a resharding holds no slot until the first one
moves to it): the client connects to the address it gives (`node_at`), for redis-py's
own commands too. See docs/cluster.md. Passwords are never shown: messages name the URL
through `redact_url`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from redis.asyncio.cluster import ClusterNode, RedisCluster

from . import redispy
from .multihost import connection_option, has_scheme, split_hosts
from .redaction import CLUSTER_SCHEMES

__all__ = ["ClusterTarget", "cluster_client", "is_cluster_url", "node_at", "parse_cluster_url"]

DEFAULT_PORT = 6379
_OWN_OPTIONS = {"password", "username", "db"}


@dataclass(frozen=True)
class ClusterTarget:
    """A parsed cluster URL. `repr` never shows a password."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: dict[str, Any] = field(default_factory=dict)  # further redis-py connection options


def is_cluster_url(url: object) -> bool:
    """Whether `url` is a redis+cluster:// or rediss+cluster:// URL."""
    return has_scheme(url, CLUSTER_SCHEMES)


def parse_cluster_url(url: str) -> ClusterTarget:
    """The parts of a cluster URL; ValueError (never quoting a password) when malformed."""
    if not is_cluster_url(url):
        raise ValueError("not a redis+cluster:// or rediss+cluster:// URL")
    parts, seeds, found = split_hosts(url, "cluster", DEFAULT_PORT, "its seed nodes as host[:port],host[:port],...")
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ValueError("a Redis Cluster has only db 0: leave the path out or give /0")
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
        if name in _OWN_OPTIONS:
            if name == "db":
                if value not in ("", "0"):
                    raise ValueError("a Redis Cluster has only db 0")
            elif not found.get(name):  # userinfo wins, as in redis-py
                found[name] = value or None
        else:
            options[name] = connection_option(name, value, "cluster")
    return ClusterTarget(tuple(seeds), tls=parts.scheme == "rediss+cluster", options=options, **found)


def node_at(client: RedisCluster, host: str, port: int) -> ClusterNode:
    """The client's node at host:port (an address a redirection gave, remapped already),
    made a node of the client when its slot map does not list it, as redis-py does with
    the node a MOVED names. It is closed with the client, or when a re-read of the slot
    map finds it serving nothing."""
    return redispy.listed_node(client, host, port) or redispy.add_node(client, host, port)


class _ClusterClient(RedisCluster):
    """A RedisCluster whose own commands follow an ASK to a node its slot map does not
    list yet. redis-py looks the node an ASK names up by address (`get_node`) and fails
    on None (AttributeError: a worker whose maintenance met it stopped); here the lookup
    connects to it (`node_at`). Its other callers only ask about nodes they got from the
    map (the default node, a sharded pubsub's)."""

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None:
            if node_name and not (host and port):  # redis-py 5.x asks by name, host:port
                host, _, port_text = node_name.rpartition(":")
                port = int(port_text) if port_text.isdigit() else None
            if host and port:
                node = node_at(self, host, port)
        return node


def cluster_client(url: str, *, max_connections: int | None = None, **redis_options: Any) -> RedisCluster:
    """A client for the cluster that `url` seeds (it connects on first use).

    `redis_options` are redis-py connection options (socket timeouts, TLS files, ...);
    options in the URL's query take precedence. `max_connections` bounds each node's
    pool (redis-py's cluster pools fail beyond it: a retryable error, never a wait).
    Raises ValueError for a malformed URL.
    """
    target = parse_cluster_url(url)
    options: dict[str, Any] = {"decode_responses": True, **redis_options, **target.options}
    for name in ("username", "password"):
        if getattr(target, name):
            options[name] = getattr(target, name)
    if target.tls:
        options["ssl"] = True
    else:
        for name in [k for k in options if k.startswith("ssl_")]:
            del options[name]  # TLS settings for a plain-text URL: nothing to apply them to
    if max_connections is not None:
        options["max_connections"] = max_connections
    # Partial coverage is served: while a dead master's replica takes over, the queues
    # on the other masters keep working (the uncovered slots' calls are retryable).
    return _ClusterClient(startup_nodes=[ClusterNode(host, port) for host, port in target.seeds],
                          require_full_coverage=False, **options)
