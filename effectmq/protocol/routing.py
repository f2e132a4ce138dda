"""Where a queue's calls go: its script runner and its subscriptions, for a plain
client or a `RedisCluster`.

On a cluster every key of a queue shares one hash tag (``{emq:<queue>}``), so each
script call has one slot and goes to that slot's master. A reply of MOVED (the slot
has another master: a failover or a resharding; the call did not run) re-reads the
slot map and sends the call again; ASK (the slot is migrating) sends it after ASKING to
the node named, connecting to it when the slot map does not know it yet (a master added
for the resharding has no slot until the first one moves to it); a lost connection
re-reads the map before the next call.

While a slot migrates, Redis refuses with TRYAGAIN a call whose keys are not all on the
node asked (the source once some moved, the target until all did); the call did not
run, so it is sent again, acquire included, after 10 ms, doubling to 500 ms (at most a
quarter of its patience), for as long as its caller can wait (`patience`): the client's
socket timeout, and for a call that grants or renews a lease a third of that lease (the
lease's local deadline is counted from before the first try). Beyond that the TRYAGAIN
reaches the caller as a retryable `RedisUnavailable`, as CLUSTERDOWN does
(`connection.RETRYABLE_REPLIES`): it backs off, as from any outage. See docs/cluster.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import redis.exceptions as redis_errors
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.crc import key_slot

from ..transport import redispy
from ..transport.cluster import node_at
from ..transport.connection import TRANSPORT_ERRORS, RedisErrors, client_settings
from .protocol import ScriptArgs
from .scripts import Confirmation, ScriptRunner, exchange

__all__ = ["ClusterScriptRunner", "Refusals", "patience", "script_runner", "subscriber"]

log = logging.getLogger("effectmq")

# Redirections followed in one try of a call; a MOVED or ASK still left is sent again
# later like a TRYAGAIN: a slot that keeps moving is an outage like any other.
MAX_REDIRECTS = 5
# A call refused for now by a migrating slot (TRYAGAIN, or redirected too often) is sent
# again after TRYAGAIN_FIRST seconds, the wait doubling up to TRYAGAIN_LIMIT (or a quarter
# of the call's patience, when shorter: a short lease's renewal tries often enough to land
# soon after the migration ends), for as long as `patience` allows.
TRYAGAIN_FIRST, TRYAGAIN_LIMIT = 0.01, 0.5
# How long a call waits for a migrating slot when the client has no socket timeout.
DEFAULT_PATIENCE = 15.0
# The share of a lease a call that grants or renews it may wait: the lease's local
# deadline counts from before the first try, so a longer wait hands out a lease that is
# mostly spent (acquire) or renews too late to matter (renew: the heartbeat's own budget
# cuts it shorter still).
LEASE_SHARE = 1 / 3

R = TypeVar("R")
_patience: ContextVar[float | None] = ContextVar("effectmq_cluster_patience", default=None)


def patience(client: Any, calls: Sequence[ScriptArgs[Any]]) -> float:
    """Seconds `calls` may be held back by a migrating slot: the client's socket timeout
    (what its caller already accepts to wait for one reply), and for calls that carry a
    lease length (acquire, renew) at most LEASE_SHARE of the shortest one."""
    timeout = client_settings(client).get("socket_timeout")
    wait = float(timeout) if timeout else DEFAULT_PATIENCE
    leases = [ms for args in calls if isinstance(ms := getattr(args, "lock_timeout_ms", None), (int, float)) and ms > 0]
    if leases:
        wait = min(wait, min(leases) / 1000 * LEASE_SHARE)
    return wait


@dataclass
class Refusals:
    """What one runner met of slot migrations: calls refused for now and sent again
    (tests, the bench and docs/cluster.md read it)."""

    replies: int = 0  # TRYAGAIN replies (and redirections left after MAX_REDIRECTS) sent again
    calls: int = 0  # calls held back at least once
    gave_up: int = 0  # calls whose patience ran out: their refusal reached the caller
    first: float | None = None  # monotonic instant of the first refusal
    last: float | None = None  # ... and of the last
    longest: float = 0.0  # the longest one call was held back (seconds)
    asked: int = 0  # ASK redirections followed
    new_nodes: int = 0  # ... to a node the slot map did not know

    @property
    def window(self) -> float:
        """From the first refusal to the last (0 when there was none)."""
        return 0.0 if self.first is None or self.last is None else self.last - self.first


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
                await redispy.reread_slot_map(client)
                self.epoch += 1
                self.stale = False


_topologies: "weakref.WeakKeyDictionary[RedisCluster, _Topology]" = weakref.WeakKeyDictionary()


def _topology(client: RedisCluster) -> _Topology:
    topology = _topologies.get(client)
    if topology is None:
        topology = _topologies[client] = _Topology()
    return topology


class ClusterScriptRunner(ScriptRunner):
    """`ScriptRunner` for a `RedisCluster`: each batch goes, on one connection, to the
    master of the queue's slot (every key of the queue shares its hash tag, so any one
    of them names the slot), follows MOVED and ASK and waits out TRYAGAIN (see the module
    docstring). `refusals` counts what it met of slot migrations."""

    def __init__(self, client: RedisCluster, keys: Sequence[str], errors: RedisErrors):
        super().__init__(client, keys, errors)
        self.slot = key_slot(self.keys[0])
        self.topology = _topology(client)
        self.refusals = Refusals()

    async def _master(self) -> ClusterNode:
        await self.client.initialize()  # once; again after redis-py closed it on an error
        if self.topology.stale:
            await self.topology.refresh(self.client, self.topology.epoch)
        return redispy.node_of_slot(self.client, self.slot)

    async def run_many(self, calls: Sequence[ScriptArgs[R]], confirm: Confirmation | None = None) -> list[R]:
        token = _patience.set(patience(self.client, calls))
        try:
            return await super().run_many(calls, confirm)
        finally:
            _patience.reset(token)

    async def _send(self, packed: list, raw: bool, confirm: Confirmation | None = None) -> list:
        """Every packed call to the slot's master (`_route`); those refused for now by a
        migrating slot again, with backoff, until they run or their patience runs out
        (then their refusal is the reply: a retryable error for the caller). With
        `confirm`, WAIT follows the calls on each connection that carried them."""
        replies: list = [None] * len(packed)
        todo = list(range(len(packed)))
        wait = _patience.get()
        if wait is None:  # a call that did not come through run_many (a reload)
            wait = patience(self.client, ())
        started = time.monotonic()
        delay, limit = TRYAGAIN_FIRST, max(TRYAGAIN_FIRST, min(TRYAGAIN_LIMIT, wait / 4))
        held = False
        while True:
            for i, reply in zip(todo, await self._route([packed[i] for i in todo], raw, confirm)):
                replies[i] = reply
            now = time.monotonic()
            refused = [i for i in todo if _refused_for_now(replies[i])]
            if refused:
                self._refused(len(refused), now)
            if not refused or now - started >= wait:
                if held:
                    self._held_back(now - started, gave_up=bool(refused))
                return replies
            await asyncio.sleep(min(delay, wait - (now - started)))  # the last try when patience ends
            delay = min(delay * 2, limit)
            todo, held = refused, True

    def _refused(self, count: int, now: float) -> None:
        stats = self.refusals
        if stats.last is None or now - stats.last > 2 * TRYAGAIN_LIMIT:  # a migration begins (for this runner)
            log.info("queue slot %d is migrating: calls it refuses for now (TRYAGAIN) are sent again", self.slot)
        if stats.first is None:
            stats.first = now
        stats.replies += count
        stats.last = now

    def _held_back(self, seconds: float, gave_up: bool) -> None:
        stats = self.refusals
        stats.calls += 1
        stats.longest = max(stats.longest, seconds)
        if gave_up:
            stats.gave_up += 1
            log.warning("queue slot %d still migrating after %.2f s: a call is refused for now", self.slot, seconds)
        elif seconds >= 1.0:
            log.info("queue slot %d: a call waited %.2f s for a migration", self.slot, seconds)

    async def _route(self, packed: list, raw: bool, confirm: Confirmation | None) -> list:
        """One try of every packed call at the slot's master, following MOVED and ASK."""
        replies: list = [None] * len(packed)
        todo = list(range(len(packed)))
        node, asking = await self._master(), False
        redirects = 0
        while True:
            moved, asked = [], []
            for i, reply in zip(todo, await self._send_to(node, [packed[i] for i in todo], raw, asking, confirm)):
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
                todo, node, asking = asked, self._asked_node(replies[asked[0]], node), True

    def _asked_node(self, ask: redis_errors.AskError, sender: ClusterNode) -> ClusterNode:
        """The node an ASK names, connected to when the slot map does not list it (a master
        added for the resharding: CLUSTER SLOTS lists it once it holds a slot)."""
        host, port = redispy.remapped(self.client, ask.host or sender.host, ask.port)
        self.refusals.asked += 1
        if redispy.listed_node(self.client, host, port) is None:
            self.refusals.new_nodes += 1
        return node_at(self.client, host, port)

    async def _send_to(self, node: ClusterNode, packed: list, raw: bool, asking: bool,
                       confirm: Confirmation | None) -> list:
        """Write the calls on one connection of `node` (each after ASKING when `asking`),
        then read every reply (errors as values)."""
        conn = node.acquire_connection()
        try:
            return await exchange(conn, packed, raw, asking=asking, confirm=confirm)
        except TRANSPORT_ERRORS as exc:
            if not isinstance(exc, redis_errors.MaxConnectionsError):
                self.topology.stale = True  # the node may be gone: re-read the map before the next call
            raise
        finally:
            redispy.release(node, conn)


def _refused_for_now(reply: Any) -> bool:
    """A reply saying the call did not run because its slot is moving: TRYAGAIN, or a
    redirection still left after MAX_REDIRECTS."""
    return isinstance(reply, (redis_errors.TryAgainError, redis_errors.AskError))


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
    node = redispy.node_for_key(client, channel)
    pool = ConnectionPool(connection_class=node.connection_class, max_connections=1, **node.connection_kwargs)
    return PubSub(pool, ignore_subscribe_messages=True)
