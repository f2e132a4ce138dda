"""redis-py's cluster internals the runtime reaches into, in one place.

redis-py has no public API for these; each was checked on redis-py 5.3.1 (the floor
pyproject allows) and 8.2.0 (the newest tested), the two versions tooling/test.sh runs
the suite on. A new redis-py major is checked here first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

import redis.exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

T = TypeVar("T")
MOVE_RETRY = 0.05  # seconds between tries of a read that redis-py gave up on while a slot moved


async def reread_slot_map(client: RedisCluster) -> None:
    """`nodes_manager.initialize()` under the lock redis-py's own `initialize()` takes
    (`client._lock`, None until first used): before redis-py 6 its re-read was not
    serialized, and two re-reads at once rewrite the startup nodes the other is
    iterating. One that still meets a rewrite (redis-py 5 also drops a failed seed
    unlocked) is an outage like the one that caused it: retried."""
    if client._lock is None:
        client._lock = asyncio.Lock()
    async with client._lock:
        try:
            await client.nodes_manager.initialize()
        except RuntimeError as exc:  # "dictionary changed size during iteration"
            raise redis_errors.ConnectionError(f"the cluster's slot map changed while it was read ({exc})") from exc


def closed_under_us(conn: Any, exc: BaseException) -> bool:
    """Whether `exc` (an AttributeError from inside redis-py) means another task closed
    `conn` while it was in use: redis-py 5's cluster client disconnects every connection
    of the nodes a slot-map re-read replaces, in-flight ones included (redis-py 8 waits
    for them), and a write or read on the closed connection then meets `_writer` or
    `_reader` gone."""
    return isinstance(exc, AttributeError) and not conn.is_connected


def node_of_slot(client: RedisCluster, slot: int) -> ClusterNode:
    """The master serving `slot` by the client's map (SlotNotCoveredError while uncovered)."""
    return client.nodes_manager.get_node_from_slot(slot)


def listed_node(client: RedisCluster, host: str, port: int) -> ClusterNode | None:
    return client.nodes_manager.get_node(host=host, port=port)


def remapped(client: RedisCluster, host: str, port: int) -> tuple[str, int]:
    """An address as the client's `address_remap` turns it (redis-py ≥ 5.0.1 has it)."""
    remap = getattr(client.nodes_manager, "remap_host_port", None)
    return remap(host, port) if remap is not None else (host, port)


def add_node(client: RedisCluster, host: str, port: int) -> ClusterNode:
    """Make host:port a node of the client, as redis-py does with the node a MOVED names."""
    manager = client.nodes_manager
    node = ClusterNode(host, int(port), "primary", **manager.connection_kwargs)
    manager.set_nodes(manager.nodes_cache, {node.name: node})
    return manager.get_node(host=host, port=port) or node


def release(node: ClusterNode, conn: Any) -> None:
    """Give a connection back to its node's pool (redis-py 5.x's ClusterNode has no
    release(): its own calls append to the free list)."""
    give_back = getattr(node, "release", None)
    if give_back is not None:
        give_back(conn)
    else:
        node._free.append(conn)


def node_for_key(client: RedisCluster, key: str) -> ClusterNode:
    """The master of `key`'s slot by the client's map; before the first call has read the
    map, a seed node."""
    owners = client.nodes_manager.slots_cache.get(key_slot(client.encoder.encode(key)))
    return owners[0] if owners else next(iter(client.nodes_manager.startup_nodes.values()))


async def riding_out_a_move(read: Callable[[], Awaitable[T]], patience: float) -> T:
    """`read()` (plain commands on a cluster client), tried again for up to `patience`
    seconds while redis-py gives up with ClusterError("TTL exhausted."): it follows 16
    redirections without pausing, and between the two SETSLOT NODE calls of a slot move
    the source answers ASK and the target MOVED, back and forth (seen on 5.3.1 in
    test_cluster_reshard; the script runner waits such a window out itself, routing.py)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await read()
        except redis_errors.ClusterError as exc:
            if "TTL exhausted" not in str(exc) or time.monotonic() + MOVE_RETRY > deadline:
                raise
        await asyncio.sleep(MOVE_RETRY)
