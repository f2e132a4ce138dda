"""Where a queue's calls go: its script runner and its subscriptions, for a plain
client or a `RedisCluster`.

On a cluster every key of a queue shares one hash tag (``{emq:<queue>}``), so each
script call has one slot and goes to that slot's master. A reply of MOVED (the slot
has another master: a failover or a resharding; the call did not run) re-reads the
slot map and sends the call again; ASK (the slot is migrating) sends it to the named
node after ASKING; a lost connection re-reads the map before the next call. TRYAGAIN
and CLUSTERDOWN are retryable (`connection.RETRYABLE_REPLIES`): the caller backs off,
as from any outage.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Sequence

import redis.exceptions as redis_errors
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.crc import key_slot

from .connection import TRANSPORT_ERRORS, RedisErrors
from .scripts import ScriptRunner, exchange

__all__ = ["ClusterScriptRunner", "script_runner", "server_time_ms", "subscriber"]

# Redirections followed for one call before its MOVED or ASK is given to the caller
# (retryable): a slot that keeps moving is an outage like any other.
MAX_REDIRECTS = 5


class _Topology:
    """The slot map of one cluster client as the script runners see it: re-read at
    most once for all the callers that found it stale at the same time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.epoch = 0  # bumped by every re-read
        self.stale = False

    async def refresh(self, client: RedisCluster, seen_epoch: int) -> None:
        async with self.lock:
            if self.epoch == seen_epoch:  # nobody re-read it meanwhile
                await _reread_slot_map(client)
                self.epoch += 1
                self.stale = False


async def _reread_slot_map(client: RedisCluster) -> None:
    """Under the lock redis-py's own `initialize()` takes: before redis-py 6 its slot map
    re-read was not serialized, and two re-reads at once rewrite the startup nodes the
    other is iterating. One that still meets a rewrite (redis-py 5 also drops a failed
    seed unlocked) is an outage like the one that caused it: retried."""
    if client._lock is None:
        client._lock = asyncio.Lock()
    async with client._lock:
        try:
            await client.nodes_manager.initialize()
        except RuntimeError as exc:  # "dictionary changed size during iteration"
            raise redis_errors.ConnectionError(f"the cluster's slot map changed while it was read ({exc})") from exc


_topologies: "weakref.WeakKeyDictionary[RedisCluster, _Topology]" = weakref.WeakKeyDictionary()


def _topology(client: RedisCluster) -> _Topology:
    topology = _topologies.get(client)
    if topology is None:
        topology = _topologies[client] = _Topology()
    return topology


class ClusterScriptRunner(ScriptRunner):
    """`ScriptRunner` for a `RedisCluster`: each batch goes, on one connection, to the
    master of the queue's slot (every key shares the queue's hash tag, so the first
    key names the slot), and follows MOVED and ASK (see the module docstring)."""

    def __init__(self, client: RedisCluster, keys: Sequence[str], errors: RedisErrors):
        super().__init__(client, keys, errors)
        self.slot = key_slot(self.keys[0])
        self.topology = _topology(client)

    async def _master(self) -> ClusterNode:
        await self.client.initialize()  # once; again after redis-py closed it on an error
        if self.topology.stale:
            await self.topology.refresh(self.client, self.topology.epoch)
        return self.client.nodes_manager.get_node_from_slot(self.slot)  # SlotNotCoveredError while uncovered

    async def _send(self, packed: list, raw: bool) -> list:
        """Every packed call to the slot's master; the redirected ones again where they are sent."""
        replies: list = [None] * len(packed)
        todo = list(range(len(packed)))
        node, asking = await self._master(), False
        redirects = 0
        while True:
            moved, asked = [], []
            for i, reply in zip(todo, await self._send_to(node, [packed[i] for i in todo], raw, asking)):
                replies[i] = reply
                if isinstance(reply, redis_errors.MovedError):  # (a MovedError is an AskError too)
                    moved.append(i)
                elif isinstance(reply, redis_errors.AskError):
                    asked.append(i)
            if not (moved or asked) or redirects == MAX_REDIRECTS:
                return replies
            redirects += 1
            if moved:  # the slot has a new master: re-read the map, send those calls (and any ASKed) there
                await self.topology.refresh(self.client, self.topology.epoch)
                todo, node, asking = moved + asked, await self._master(), False
            else:
                ask = replies[asked[0]]
                target = self.client.nodes_manager.get_node(host=ask.host, port=ask.port)
                if target is None:  # a node the map does not know yet
                    await self.topology.refresh(self.client, self.topology.epoch)
                    target = self.client.nodes_manager.get_node(host=ask.host, port=ask.port)
                    if target is None:
                        return replies
                todo, node, asking = asked, target, True

    async def _send_to(self, node: ClusterNode, packed: list, raw: bool, asking: bool) -> list:
        """Write the calls on one connection of `node` (each after ASKING when `asking`),
        then read every reply (errors as values)."""
        conn = node.acquire_connection()
        try:
            return await exchange(conn, packed, raw, asking=asking)
        except TRANSPORT_ERRORS as exc:
            if not isinstance(exc, redis_errors.MaxConnectionsError):
                self.topology.stale = True  # the node may be gone: re-read the map before the next call
            raise
        finally:
            _release(node, conn)


def _release(node: ClusterNode, conn: Any) -> None:
    """Give a connection back to its node's pool (redis-py 5.x's ClusterNode has no
    release(): its own calls append to the free list)."""
    release = getattr(node, "release", None)
    if release is not None:
        release(conn)
    else:
        node._free.append(conn)


def script_runner(client: Any, keys: Sequence[str], errors: RedisErrors) -> ScriptRunner:
    """The script runner for `client`: routed by slot on a RedisCluster."""
    if isinstance(client, RedisCluster):
        return ClusterScriptRunner(client, keys, errors)
    return ScriptRunner(client, keys, errors)


def subscriber(client: Any, channel: str) -> PubSub:
    """A PubSub (ignoring subscribe confirmations) that will hear `channel`.

    On a cluster, classic PUBLISH reaches every node, so one connection to the
    master of the channel's slot hears it (redis-py 5.x has no asyncio cluster pubsub);
    before the first call has read the slot map, a seed node.
    """
    if not isinstance(client, RedisCluster):
        return client.pubsub(ignore_subscribe_messages=True)
    owners = client.nodes_manager.slots_cache.get(key_slot(client.encoder.encode(channel)))
    node = owners[0] if owners else next(iter(client.nodes_manager.startup_nodes.values()))
    pool = ConnectionPool(connection_class=node.connection_class, max_connections=1, **node.connection_kwargs)
    return PubSub(pool, ignore_subscribe_messages=True)


async def server_time_ms(client: Any, key: str) -> int:
    """Redis time (ms) of the server that holds `key`: on a cluster, the master of its
    slot (redis-py sends a keyless TIME to any node, and refuses it in a pipeline)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        seconds, micros = await client.execute_command("TIME", target_nodes=client.get_node_from_key(key))
    else:
        seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000
