"""The operator's Redis clients on real redis-servers: shared per distinct Redis, and
closed once nobody uses them (a rotated Secret leaves its old URL behind)."""

from __future__ import annotations

import asyncio

from effectmq_operator.connections import IDLE_CLIENT, Connections, RedisTarget


def others(server) -> int:
    """Connections the server holds, except the one asking."""
    client = server.client()
    try:
        own = client.client_id()
        return sum(1 for c in client.client_list() if int(c["id"]) != own)
    finally:
        client.close()


async def test_a_client_nobody_uses_is_closed(make_redis):
    old, new = make_redis(), make_redis()
    now = [1000.0]
    connections = Connections(kube=None, clock=lambda: now[0])
    try:
        old_target, new_target = RedisTarget(old.url), RedisTarget(new.url)
        assert connections.queue(old_target, "a").redis is connections.queue(old_target, "b").redis
        await connections.queue(old_target, "a").stats()
        assert others(old) == 1
        now[0] += IDLE_CLIENT / 2
        await connections.queue(new_target, "a").stats()
        assert others(old) == 1, "still in use a while ago"
        now[0] += IDLE_CLIENT / 2 + 1
        await connections.queue(new_target, "a").stats()
        await asyncio.sleep(0.2)  # the close runs on its own
        assert others(old) == 0
        assert others(new) == 1
    finally:
        await connections.close()
